"""rlpost's protobuf schema against the official SDK's own encoders and decoders (tinker 0.38)."""

import pytest
import torch

from rlpost.serve.wire import (
    BadRequest,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
    model_input_tokens,
)

pytestmark = pytest.mark.unit

tinker = pytest.importorskip("tinker", reason="the tinker SDK is in the dev extra")
from tinker import types  # noqa: E402
from tinker.proto import request_conv, response_conv  # noqa: E402


def _sdk_request(data, loss_fn="cross_entropy", config=None, forward_only=False) -> bytes:
    request = types.ForwardBackwardRequest(
        model_id="s:train:0",
        seq_id=7,
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
    )
    message = request_conv.forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


def test_a_forward_backward_request_decodes_as_the_sdk_encoded_it():
    dense = types.Datum(
        model_input=types.ModelInput.from_ints([3, 4, 5]),
        loss_fn_inputs={"target_tokens": [4, 5, 6], "weights": [0.0, 1.0, 0.5]},
    )
    topk = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={
            "target_tokens": torch.tensor([[2, 9], [3, 8]]),
            # mostly zeros: the SDK sends it as a sparse CSR tensor
            "weights": torch.tensor([[1.0, 0.0], [0.0, 0.0]]),
        },
    )
    call = decode_forward_backward(_sdk_request([dense, topk], "ppo", {"clip_low_threshold": 0.7}, forward_only=True))
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 7, "ppo", True)
    assert call.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    assert call.data[0].tokens == [3, 4, 5]
    assert call.data[0].inputs["target_tokens"].tolist() == [4, 5, 6]
    assert call.data[0].inputs["weights"].tolist() == [0.0, 1.0, 0.5]
    assert call.data[1].inputs["target_tokens"].tolist() == [[2, 9], [3, 8]]
    assert call.data[1].inputs["weights"].tolist() == [[1.0, 0.0], [0.0, 0.0]]


def test_a_text_config_value_and_garbage_are_refused_with_the_field():
    datum = types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [2]})
    with pytest.raises(BadRequest, match="loss_fn_config.loss_id: text values"):
        decode_forward_backward(_sdk_request([datum], "custom", {"loss_id": "abc"}))
    with pytest.raises(BadRequest, match="not a ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff")


def test_forward_backward_outputs_decode_in_the_sdk_as_written():
    outputs = [{"logprobs": torch.tensor([-1.0, -2.0, -3.0])}, {"logprobs": torch.tensor([[-0.5, -4.0]])}]
    decoded = response_conv.deserialize_forward_backward_output(
        encode_forward_backward_output(outputs[:1], {"loss:sum": 6.0})
    )
    assert decoded.metrics == {"loss:sum": 6.0}
    assert decoded.loss_fn_outputs[0]["logprobs"].tolist() == [-1.0, -2.0, -3.0]
    decoded = response_conv.deserialize_forward_backward_output(encode_forward_backward_output(outputs[1:], {}))
    assert decoded.loss_fn_outputs[0]["logprobs"].to_numpy().shape == (1, 2)


def test_a_sample_response_decodes_in_the_sdk_as_written():
    result = {
        "sequences": [
            {"tokens": [7, 8], "logprobs": [-0.25, -1.5], "stop_reason": "stop"},
            {"tokens": [9], "logprobs": [-2.0], "stop_reason": "length"},
        ],
        "prompt_logprobs": [None, -3.0, -4.5],
        "topk_prompt_logprobs": [None, [(5, -0.1), (6, -2.0)], [(4, -0.2)]],
    }
    decoded = response_conv.deserialize_sample_response(encode_sample_response(result, prompt_length=3))
    assert [s.tokens for s in decoded.sequences] == [[7, 8], [9]]
    assert decoded.sequences[0].logprobs == pytest.approx([-0.25, -1.5])
    assert [s.stop_reason for s in decoded.sequences] == ["stop", "length"]
    assert decoded.prompt_logprobs[0] is None and decoded.prompt_logprobs[1:] == pytest.approx([-3.0, -4.5])
    assert decoded.topk_prompt_logprobs[0] is None
    assert decoded.topk_prompt_logprobs[1] == [(5, pytest.approx(-0.1)), (6, pytest.approx(-2.0))]
    assert decoded.topk_prompt_logprobs[2] == [(4, pytest.approx(-0.2))]


def test_json_model_inputs():
    chunks = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}, {"type": "encoded_text", "tokens": [3]}]}
    assert model_input_tokens("prompt", chunks) == [1, 2, 3]
    with pytest.raises(BadRequest, match="prompt.chunks\\[0\\]: 'image' chunks"):
        model_input_tokens("prompt", {"chunks": [{"type": "image", "data": ""}]})
