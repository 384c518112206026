"""The Tinker API's bodies: protobuf messages (the schema written out below), JSON model inputs, and the
conversions between them and what the trainer and the engines take.

The official SDK (``tinker`` 0.38) sends ``forward_backward`` as a protobuf
``tinker_public.ForwardBackwardRequest`` (zstd-compressed when the server asks for it) and reads
the results of ``forward_backward`` and ``asample`` only as protobuf (``ForwardBackwardOutput``,
``SampleResponse``); everything else is JSON. The schema is declared here field by field (names,
numbers and types as the SDK's messages have them), so the server depends on protobuf's runtime
only, not on the client's package. Arrays travel as little-endian bytes: token ids as int32,
tensors in their dtype, per-datum outputs concatenated with byte offsets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from rlpost.actors.adapters import Datum

PACKAGE = "tinker_public"
PROTOBUF = "application/x-protobuf"

# (message, [(field, number, type, label-or-map, message type)]); "map:K,V" declares a map field
_T = descriptor_pb2.FieldDescriptorProto
_SCHEMA: dict[str, list[tuple]] = {
    "LossConfigValue": [("number", 1, _T.TYPE_DOUBLE, "oneof:value"), ("text", 2, _T.TYPE_STRING, "oneof:value")],
    "EncodedTextChunk": [("tokens", 1, _T.TYPE_BYTES)],
    "ImageChunk": [("data", 1, _T.TYPE_BYTES), ("format", 2, _T.TYPE_STRING)],
    "DmelChunk": [("dmel", 1, _T.TYPE_BYTES)],
    "Chunk": [
        ("encoded_text", 1, _T.TYPE_MESSAGE, "oneof:chunk", "EncodedTextChunk"),
        ("image", 2, _T.TYPE_MESSAGE, "oneof:chunk", "ImageChunk"),
        ("dmel", 3, _T.TYPE_MESSAGE, "oneof:chunk", "DmelChunk"),
    ],
    "SparseCsr": [("values", 1, _T.TYPE_BYTES), ("crow_indices", 2, _T.TYPE_BYTES), ("col_indices", 3, _T.TYPE_BYTES)],
    "Tensor": [
        ("dense", 1, _T.TYPE_BYTES, "oneof:encoding"),
        ("sparse_csr", 2, _T.TYPE_MESSAGE, "oneof:encoding", "SparseCsr"),
        ("dtype", 3, _T.TYPE_ENUM, None, "DType"),
        ("shape", 4, _T.TYPE_INT64, "repeated"),
    ],
    "Datum": [
        ("model_input", 1, _T.TYPE_MESSAGE, "repeated", "Chunk"),
        ("loss_fn_inputs", 2, _T.TYPE_MESSAGE, "map", ("string", "Tensor")),
    ],
    "ForwardBackwardRequest": [
        ("model_id", 1, _T.TYPE_STRING),
        ("seq_id", 2, _T.TYPE_INT32),
        ("data", 3, _T.TYPE_MESSAGE, "repeated", "Datum"),
        ("loss_fn", 4, _T.TYPE_STRING),
        ("loss_fn_config", 5, _T.TYPE_MESSAGE, "map", ("string", _T.TYPE_DOUBLE)),
        ("forward_only", 6, _T.TYPE_BOOL),
        ("loss_fn_config_v2", 7, _T.TYPE_MESSAGE, "map", ("string", "LossConfigValue")),
    ],
    "BatchedTensor": [
        ("data", 1, _T.TYPE_BYTES),
        ("offsets", 2, _T.TYPE_BYTES),
        ("dtype", 3, _T.TYPE_ENUM, None, "DType"),
        ("trailing_shape", 4, _T.TYPE_INT64, "repeated"),
    ],
    "ArrayRecord": [
        ("type_tag", 1, _T.TYPE_STRING),
        ("fields", 2, _T.TYPE_MESSAGE, "map", ("string", "BatchedTensor")),
        ("num_datums", 3, _T.TYPE_INT64),
    ],
    "ForwardBackwardOutput": [
        ("loss_fn_output_type", 1, _T.TYPE_STRING),
        ("loss_fn_outputs", 2, _T.TYPE_MESSAGE, "repeated", "ArrayRecord"),
        ("metrics", 3, _T.TYPE_MESSAGE, "map", ("string", _T.TYPE_DOUBLE)),
    ],
    "TopkLogprobs": [
        ("token_ids", 1, _T.TYPE_BYTES),
        ("logprobs", 2, _T.TYPE_BYTES),
        ("k", 3, _T.TYPE_UINT32),
        ("length", 4, _T.TYPE_UINT32),
    ],
    "SampledSequence": [
        ("stop_reason", 1, _T.TYPE_ENUM, None, "StopReason"),
        ("tokens", 2, _T.TYPE_BYTES),
        ("logprobs", 3, _T.TYPE_BYTES, "optional"),
    ],
    "SampleResponse": [
        ("sequences", 1, _T.TYPE_MESSAGE, "repeated", "SampledSequence"),
        ("prompt_logprobs", 2, _T.TYPE_BYTES, "optional"),
        ("topk_prompt_logprobs", 3, _T.TYPE_MESSAGE, "optional", "TopkLogprobs"),
    ],
}
_ENUMS = {
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
}
_NUMPY = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4")}  # DType -> array dtype
# a padding cell of a top-k table, as the SDK reads it
TOPK_PAD_LOGPROB = -99999.0


def _build_messages() -> dict[str, type]:
    """Message classes for :data:`_SCHEMA` in a pool of their own (proto3)."""
    file = descriptor_pb2.FileDescriptorProto(name="rlpost_tinker_wire.proto", package=PACKAGE, syntax="proto3")
    for name, values in _ENUMS.items():
        file.enum_type.add(name=name, value=[descriptor_pb2.EnumValueDescriptorProto(name=v, number=i)
                                             for i, v in enumerate(values)])  # fmt: skip
    for name, fields in _SCHEMA.items():
        message = file.message_type.add(name=name)
        oneofs: dict[str, int] = {}
        for spec in fields:
            field_name, number, kind = spec[:3]
            how = spec[3] if len(spec) > 3 else None
            type_name = spec[4] if len(spec) > 4 else None
            field = message.field.add(name=field_name, number=number, type=kind, label=_T.LABEL_OPTIONAL)
            if how == "map":
                entry = message.nested_type.add(name=_camel(field_name) + "Entry")
                entry.options.map_entry = True
                key, value = type_name
                entry.field.add(name="key", number=1, type=_T.TYPE_STRING, label=_T.LABEL_OPTIONAL)
                value_field = entry.field.add(name="value", number=2, label=_T.LABEL_OPTIONAL)
                if isinstance(value, str):
                    value_field.type, value_field.type_name = _T.TYPE_MESSAGE, f".{PACKAGE}.{value}"
                else:
                    value_field.type = value
                field.label, field.type_name = _T.LABEL_REPEATED, f".{PACKAGE}.{name}.{entry.name}"
                continue
            if how == "repeated":
                field.label = _T.LABEL_REPEATED
            elif how == "optional":  # proto3 optional: a synthetic oneof, so presence is kept
                field.proto3_optional = True
                field.oneof_index = len(message.oneof_decl)
                message.oneof_decl.add(name=f"_{field_name}")
            elif how and how.startswith("oneof:"):
                group = how.split(":", 1)[1]
                if group not in oneofs:
                    oneofs[group] = len(message.oneof_decl)
                    message.oneof_decl.add(name=group)
                field.oneof_index = oneofs[group]
            if type_name is not None:
                field.type_name = f".{PACKAGE}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}")) for name in _SCHEMA}


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


MESSAGES = _build_messages()


# ----------------------------------------------------------------------------------- requests


@dataclass
class ForwardBackwardCall:
    """A decoded ``forward_backward`` (or ``forward``) request."""

    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool


class BadRequest(ValueError):
    """A request the client must fix; the message names the field."""


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    request = MESSAGES["ForwardBackwardRequest"]()
    try:
        request.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise BadRequest(f"body: not a ForwardBackwardRequest ({exc})") from None
    config = dict(request.loss_fn_config)
    for key, value in request.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise BadRequest(f"loss_fn_config.{key}: text values are not supported (a number is expected)")
        config[key] = value.number
    data = [_datum(i, d) for i, d in enumerate(request.data)]
    return ForwardBackwardCall(request.model_id, int(request.seq_id), data, request.loss_fn, config,
                               bool(request.forward_only))  # fmt: skip


def _datum(index: int, datum) -> Datum:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise BadRequest(
                f"data[{index}].model_input: {kind or 'an unknown'} chunk; this server takes token chunks only"
            )
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
    inputs = {key: _proto_tensor(f"data[{index}].loss_fn_inputs.{key}", t) for key, t in datum.loss_fn_inputs.items()}
    return Datum(tokens, inputs)


def _proto_tensor(where: str, tensor) -> torch.Tensor:
    dtype = _NUMPY.get(int(tensor.dtype))
    if dtype is None:
        raise BadRequest(f"{where}: dtype {int(tensor.dtype)} is not float32, int64 or int32")
    shape = [int(s) for s in tensor.shape]
    if tensor.WhichOneof("encoding") == "sparse_csr":
        csr = tensor.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype="<i8")
        col = np.frombuffer(csr.col_indices, dtype="<i8")
        return _dense_from_csr(where, values, crow, col, shape)
    flat = np.frombuffer(tensor.dense, dtype=dtype)
    return _shaped(where, flat, shape)


def _shaped(where: str, flat: np.ndarray, shape: list[int]) -> torch.Tensor:
    if shape and math.prod(shape) != flat.size:
        raise BadRequest(f"{where}: {flat.size} values do not fill shape {shape}")
    return torch.from_numpy(flat.copy()).reshape(shape or [flat.size])


def _dense_from_csr(where, values, crow, col, shape) -> torch.Tensor:
    if len(shape) != 2 or crow.size != shape[0] + 1 or col.size != values.size:
        raise BadRequest(f"{where}: a sparse tensor needs a 2-D shape and matching CSR indices, got shape {shape}")
    if (col < 0).any() or (col >= shape[1]).any():
        raise BadRequest(f"{where}: a sparse column index is outside the shape {shape}")
    dense = np.zeros(shape, dtype=values.dtype)
    rows = np.repeat(np.arange(shape[0]), np.diff(crow))
    dense[rows, col] = values
    return torch.from_numpy(dense)


def model_input_tokens(where: str, model_input: Any) -> list[int]:
    """The token ids of a JSON ``ModelInput`` (its ``encoded_text`` chunks, in order)."""
    if not isinstance(model_input, dict) or not isinstance(model_input.get("chunks"), list):
        raise BadRequest(f"{where}: a ModelInput with 'chunks' is expected")
    tokens: list[int] = []
    for i, chunk in enumerate(model_input["chunks"]):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise BadRequest(f"{where}.chunks[{i}]: {kind!r} chunks are not supported; this server takes token chunks")
        tokens.extend(int(t) for t in chunk.get("tokens", []))
    return tokens


# ------------------------------------------------------------------------------------ results


def encode_forward_backward_output(outputs: list[dict[str, torch.Tensor]], metrics: dict[str, float]) -> bytes:
    """``ForwardBackwardOutput`` with one record holding each datum's outputs (``logprobs``),
    concatenated with byte offsets; datums in request order."""
    result = MESSAGES["ForwardBackwardOutput"](loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        result.metrics[key] = float(value)
    if outputs:
        record = result.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
        for name in outputs[0]:
            arrays = [np.ascontiguousarray(o[name].detach().cpu().numpy().astype("<f4")) for o in outputs]
            trailing = list(arrays[0].shape[1:])
            sizes = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8")
            field = record.fields[name]
            field.data = b"".join(a.tobytes() for a in arrays)
            field.offsets = sizes.tobytes()
            field.dtype = 1
            field.trailing_shape.extend(trailing)
    return result.SerializeToString()


def encode_sample_response(result: dict[str, Any], prompt_length: int) -> bytes:
    """``SampleResponse`` from :meth:`LocalVLLMClient.sample`'s result; prompt log-probs are NaN
    where there is none (position 0), top-k rows padded to k."""
    response = MESSAGES["SampleResponse"]()
    for seq in result["sequences"]:
        response.sequences.add(
            stop_reason=1 if seq["stop_reason"] == "length" else 0,
            tokens=np.asarray(seq["tokens"], dtype="<i4").tobytes(),
            logprobs=np.asarray(seq["logprobs"], dtype="<f4").tobytes(),
        )
    if result.get("prompt_logprobs") is not None:
        values = [math.nan if v is None else v for v in result["prompt_logprobs"]]
        values += [math.nan] * (prompt_length - len(values))
        response.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    topk = result.get("topk_prompt_logprobs")
    if topk:
        k = max((len(row) for row in topk if row), default=0)
        ids = np.zeros((len(topk), k), dtype="<i4")
        lps = np.full((len(topk), k), TOPK_PAD_LOGPROB, dtype="<f4")
        for i, row in enumerate(topk):
            for j, (token, lp) in enumerate(row or []):
                ids[i, j], lps[i, j] = token, lp
        response.topk_prompt_logprobs.token_ids = ids.tobytes()
        response.topk_prompt_logprobs.logprobs = lps.tobytes()
        response.topk_prompt_logprobs.k = k
        response.topk_prompt_logprobs.length = len(topk)
    return response.SerializeToString()


def sampling_params(
    body: dict[str, Any], prompt_len: int, n: int, max_model_len: int
) -> tuple[dict[str, Any], int | None]:
    """An ``asample`` body's vLLM sampling parameters and what it asks of prompt log-probs (None:
    nothing; else how many top log-probs per prompt token, 0 for the token's own only), checked
    against the model's length."""
    if not prompt_len:
        raise BadRequest("prompt: no tokens")
    if not 1 <= n <= 1024:
        raise BadRequest(f"num_samples: {n} is outside 1..1024")
    sp = body.get("sampling_params") or {}
    room = max_model_len - prompt_len
    max_tokens = sp.get("max_tokens")
    max_tokens = room if max_tokens is None else int(max_tokens)
    if room < 1 or not 1 <= max_tokens <= room:
        raise BadRequest(
            f"sampling_params.max_tokens: {max_tokens} with a {prompt_len}-token prompt does not fit the "
            f"model's {max_model_len} tokens"
        )
    params: dict[str, Any] = {"max_tokens": max_tokens, "temperature": float(sp.get("temperature", 1.0)),
                              "top_p": float(sp.get("top_p", 1.0)), "top_k": int(sp.get("top_k", -1))}  # fmt: skip
    if sp.get("seed") is not None:
        params["seed"] = int(sp["seed"])
    stop = sp.get("stop")
    if isinstance(stop, str):
        params["stop"] = [stop]
    elif isinstance(stop, list) and stop and all(isinstance(s, str) for s in stop):
        params["stop"] = stop
    elif isinstance(stop, list) and stop and all(isinstance(s, int) for s in stop):
        params["stop_token_ids"] = stop
    elif stop == []:
        params["ignore_eos"] = True  # no stop at all, the end-of-sequence token included
    elif stop is not None:
        raise BadRequest("sampling_params.stop: a string, a list of strings or a list of token ids")
    if not body.get("prompt_logprobs"):
        return params, None
    return params, max(0, int(body.get("topk_prompt_logprobs") or 0))
