"""The service's trainer: many clients' LoRA adapters over one copy of a base model, trained per
request (:class:`AdapterTrainer`; :func:`start_adapter_trainer` runs it as a Ray actor).

A client's model is a named peft adapter on the shared, frozen base. A request runs on one
adapter: ``forward_backward`` computes the log-probs of the client's target tokens, a loss from
:mod:`rlpost.algo.token_losses` summed over the request, and adds its gradient to that adapter's;
``optim_step`` applies the sum with the adapter's own AdamW and clears it. Adapters are separate
parameters and each has its own optimizer, so interleaving two clients' requests changes neither
one's result.

The output head is not adapted even where a client asks (``train_unembed``, on by default in the
Tinker SDK): vLLM serves no LoRA on the head, so an adapted head would make the service's samples
come from another model than the one it trains (a deliberate difference; ``info()["target_modules"]``
lists the layers adapted). ``AdapterTrainer(adapt_unembed=True)`` adapts it, for a trainer whose
adapters no vLLM engine serves.

The adapter's scale is ``alpha / rank`` with ``alpha = 32`` whatever the rank: a learning rate
then carries across ranks (the LoRA-without-regret convention of the Tinker service), where
``alpha = rank`` would scale the update with the rank.

Memory: at most ``max_resident`` adapters are in the model (on the trainer's device), each with its
gradient and AdamW state. Using another parks the least recently used one: its tensors, gradient
and optimizer state are copied to host memory and the adapter leaves the model; past
``max_parked_in_memory`` parked ones, the oldest is written to a file in ``spill_dir``. A parked
model comes back unchanged (the same tensors, gradient and optimizer state) when it is used next.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlpost.algo.chunked import chunked_token_logprobs
from rlpost.algo.token_losses import check_loss, token_loss
from rlpost.runtime.liveness import working

log = logging.getLogger(__name__)

LORA_ALPHA = 32
OPTIMIZER_FILE = "optimizer.pt"
MODEL_FILE = "rlpost_model.json"
# a forward pass takes at most this many tokens; a larger request runs in several
DEFAULT_MAX_BATCH_TOKENS = 8192


@dataclass(frozen=True)
class AdapterSpec:
    """A client model's adapter: its rank, the seed of its initial A matrices, and which layers
    it adapts (attention projections, MLP projections, the output head)."""

    rank: int = 32
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass
class Datum:
    """One sequence of a request: its input tokens and the loss inputs per position
    (``target_tokens`` ``[N]`` or ``[N, K]``, and ``weights``, ``logprobs``, ``advantages``)."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class AdamParams:
    """One optimizer step's hyperparameters (``grad_clip_norm`` 0: no clipping)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class Parked:
    """A model's adapter out of the trainer's model: its parameters, gradients and AdamW state
    (``state``, on the CPU), or the file they were written to (``path``)."""

    state: dict[str, Any] | None
    path: Path | None = None


class AdapterTrainer:
    """One base model and the adapters of the clients' models; see the module docstring.
    ``max_resident`` / ``max_parked_in_memory``: 0 is no bound."""

    def __init__(self, base_model: str, *, dtype: str = "float32", max_rank: int = 64,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, threads: int | None = None,
                 adapt_unembed: bool = False, max_resident: int = 0, max_parked_in_memory: int = 0,
                 spill_dir: str | None = None):  # fmt: skip
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.base_model = base_model
        self.max_rank = max_rank
        self.max_batch_tokens = max_batch_tokens
        self.adapt_unembed = adapt_unembed
        self.max_resident, self.max_parked_in_memory = max_resident, max_parked_in_memory
        self._spill_root = tempfile.TemporaryDirectory(prefix="rlpost-parked-", dir=spill_dir)
        self.resident: OrderedDict[str, None] = OrderedDict()  # in the model, least recently used first
        self.parked: OrderedDict[str, Parked] = OrderedDict()  # out of it, parked longest first
        self.moves = {"parked": 0, "spilled": 0, "unparked": 0}
        base = AutoModelForCausalLM.from_pretrained(base_model, dtype=getattr(torch, dtype))
        base.requires_grad_(False)
        self.vocab_size = int(base.get_output_embeddings().weight.shape[0])
        self.max_length = int(getattr(base.config, "max_position_embeddings", 0) or 0) or None
        self._base = base
        self._linear_layers = _linear_layers(base)
        self.model: Any = None  # the peft model once an adapter exists
        self.specs: dict[str, AdapterSpec] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.steps: dict[str, int] = {}

    # ------------------------------------------------------------------------------ adapters

    def layers_for(self, spec: AdapterSpec) -> list[str]:
        """The leaf names of the linear layers ``spec`` adapts, as peft's ``target_modules``."""
        chosen = {"attn": spec.train_attn, "mlp": spec.train_mlp, "unembed": spec.train_unembed and self.adapt_unembed}
        return sorted(name for kind, names in self._linear_layers.items() if chosen[kind] for name in names)

    def create(self, model_id: str, spec: AdapterSpec) -> dict[str, Any]:
        """Add a fresh adapter (B = 0: it computes the base model) and its optimizer."""
        if model_id in self.specs:
            raise ValueError(f"model_id: {model_id!r} exists already")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{2,127}", model_id) or "lora" in model_id:
            # peft keys parameters by the adapter's name: no dots, and not a piece of "lora_"
            raise ValueError(f"model_id: {model_id!r} must be 3-128 letters, digits, '_' or '-', without 'lora'")
        if not 1 <= spec.rank <= self.max_rank:
            raise ValueError(
                f"lora_config.rank: {spec.rank} is outside 1..{self.max_rank} (the server's max_lora_rank)"
            )
        targets = self.layers_for(spec)
        if not targets:
            raise ValueError("lora_config: train_attn and train_mlp are both false; nothing this server adapts")
        self._add_to_model(model_id, spec)
        self.specs[model_id] = spec
        self.optimizers[model_id] = torch.optim.AdamW(self._parameters(model_id), lr=1e-4)
        self.steps[model_id] = 0
        self._bound_resident()
        return self.info(model_id)

    def _add_to_model(self, model_id: str, spec: AdapterSpec) -> None:
        """A fresh adapter for ``spec`` in the model (B = 0; A from ``spec.seed``), made resident."""
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=self.layers_for(spec),
                            bias="none", task_type="CAUSAL_LM")  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            if spec.seed is not None:
                torch.manual_seed(spec.seed)
            if self.model is None:
                self.model = get_peft_model(self._base, config, adapter_name=model_id)
            else:
                self.model.add_adapter(model_id, config)
        self.resident[model_id] = None

    def _drop_from_model(self, model_id: str) -> None:
        del self.resident[model_id]
        if self.resident:
            with warnings.catch_warnings():  # peft's note that another adapter is now active: each call sets its own
                warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
                self.model.delete_adapter(model_id)
        else:  # peft cannot delete its last adapter: unwrap to the bare base
            self._base = self.model.unload()
            self.model = None

    def info(self, model_id: str) -> dict[str, Any]:
        spec = self._known(model_id)
        return {"model_id": model_id, "base_model": self.base_model, "lora": asdict(spec), "step": self.steps[model_id],
                "target_modules": self.layers_for(spec)}  # fmt: skip

    def remove(self, model_id: str) -> None:
        self._known(model_id)
        del self.specs[model_id], self.steps[model_id]
        parked = self.parked.pop(model_id, None)
        if parked is not None:
            if parked.path is not None:
                parked.path.unlink(missing_ok=True)
            return
        del self.optimizers[model_id]
        self._drop_from_model(model_id)

    def memory(self) -> dict[str, int]:
        """Where the models' adapters are (in the model, parked in host memory, in files) and the
        moves so far (parked, spilled to a file, brought back); cheap: counts only."""
        on_disk = sum(1 for p in self.parked.values() if p.path is not None)
        return {"resident": len(self.resident), "in_memory": len(self.parked) - on_disk, "on_disk": on_disk,
                **self.moves}  # fmt: skip

    def memory_bytes(self) -> dict[str, int]:
        """The bytes of the models' tensors (adapter, gradient, optimizer state) in each place."""
        resident = 0
        if self.model is not None:
            for name, param in self.model.named_parameters():
                if "lora_" in name:  # a resident adapter's (parked ones are out of the model)
                    resident += param.nbytes + (param.grad.nbytes if param.grad is not None else 0)
        resident += sum(_nbytes(opt.state_dict()["state"]) for opt in self.optimizers.values())
        return {"resident": resident, "in_memory": sum(_nbytes(p.state) for p in self.parked.values() if p.state),
                "on_disk": sum(p.path.stat().st_size for p in self.parked.values() if p.path is not None)}  # fmt: skip

    def _known(self, model_id: str) -> AdapterSpec:
        if model_id not in self.specs:
            raise KeyError(f"model_id: no model {model_id!r} on this trainer")
        return self.specs[model_id]

    def _spec(self, model_id: str) -> AdapterSpec:
        """``model_id``'s spec, its adapter brought into the model (the most recently used)."""
        self._known(model_id)
        if model_id in self.parked:
            self._unpark(model_id)
        self.resident.move_to_end(model_id)
        self._bound_resident()
        return self.specs[model_id]

    # ------------------------------------------------------------------------- parking

    def _bound_resident(self) -> None:
        while self.max_resident and len(self.resident) > self.max_resident:
            self._park(next(iter(self.resident)))

    def _park(self, model_id: str) -> None:
        """Move ``model_id``'s adapter, gradient and optimizer state out of the model (module docstring)."""
        named = self._named_parameters(model_id)
        state = {
            "tensors": {name: p.detach().to("cpu", copy=True) for name, p in named.items()},
            "grads": {name: p.grad.detach().to("cpu", copy=True) for name, p in named.items() if p.grad is not None},
            "optimizer": _on_cpu(self.optimizers.pop(model_id).state_dict()),
        }
        self._drop_from_model(model_id)
        self.parked[model_id] = Parked(state)
        self.moves["parked"] += 1
        in_memory = [mid for mid, p in self.parked.items() if p.state is not None]
        excess = len(in_memory) - self.max_parked_in_memory if self.max_parked_in_memory else 0
        for oldest in in_memory[: max(0, excess)]:  # to a file, parked longest first
            parked = self.parked[oldest]
            parked.path = Path(self._spill_root.name) / f"{oldest}.pt"
            torch.save(parked.state, parked.path)
            parked.state = None
            self.moves["spilled"] += 1

    def _unpark(self, model_id: str) -> None:
        """Bring a parked model back into the model as it was parked."""
        parked = self.parked.pop(model_id)
        state = parked.state if parked.path is None else torch.load(parked.path, weights_only=True)
        if parked.path is not None:
            parked.path.unlink(missing_ok=True)
        self._add_to_model(model_id, self.specs[model_id])
        named = self._named_parameters(model_id)
        if set(named) != set(state["tensors"]):
            raise RuntimeError(f"{model_id}: the parked adapter's tensors do not match the model's layers")
        with torch.no_grad():
            for name, param in named.items():
                param.copy_(state["tensors"][name])
                grad = state["grads"].get(name)
                param.grad = None if grad is None else grad.to(param.device)
        self.optimizers[model_id] = torch.optim.AdamW(self._parameters(model_id), lr=1e-4)
        self.optimizers[model_id].load_state_dict(state["optimizer"])
        self.moves["unparked"] += 1

    def _named_parameters(self, model_id: str) -> dict[str, torch.nn.Parameter]:
        """``model_id``'s adapter parameters by their peft names (the model's order)."""
        marker = f".{model_id}."
        return {name: p for name, p in self.model.named_parameters() if marker in name and "lora_" in name}

    def _parameters(self, model_id: str) -> list[torch.nn.Parameter]:
        return list(self._named_parameters(model_id).values())

    @contextmanager
    def _active(self, model_id: str) -> Iterator[None]:
        """Compute with ``model_id``'s adapter, and let only its parameters take gradients."""
        self._spec(model_id)
        self.model.set_adapter(model_id)  # peft marks the active adapter's parameters trainable
        yield

    # ------------------------------------------------------------------------------ training

    def forward_backward(self, model_id: str, data: Sequence[Datum], loss_fn: str,
                         loss_fn_config: dict[str, float] | None = None, *, backward: bool = True) -> dict[str, Any]:  # fmt: skip
        """The loss ``loss_fn`` of ``data`` under ``model_id``'s adapter, its gradient added to the
        adapter's (``backward=False``: a forward only). Returns ``{"loss_fn_outputs": [{"logprobs":
        tensor}, ...], "metrics": {"loss:sum": float}}``: each datum's target log-probs."""
        check_loss(loss_fn, loss_fn_config)
        self._check_data(data)
        outputs: list[dict[str, torch.Tensor]] = []
        total = 0.0
        with self._active(model_id), working("forward_backward"), torch.set_grad_enabled(backward):
            for batch in self._batches(data):
                logprobs = self._target_logprobs(batch)
                loss = sum(token_loss(loss_fn, lp, datum.inputs, loss_fn_config) for lp, datum in zip(logprobs, batch))
                if backward and loss.requires_grad:
                    loss.backward()
                total += float(loss.detach())
                outputs.extend({"logprobs": lp.detach().float()} for lp in logprobs)
        return {"loss_fn_outputs": outputs, "metrics": {"loss:sum": total}}

    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        """Apply the gradient summed since the last step with the adapter's AdamW, then clear it."""
        self._spec(model_id)
        optimizer = self.optimizers[model_id]
        parameters = self._parameters(model_id)
        for group in optimizer.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)  # fmt: skip
        # the norm before clipping (clip_grad_norm_ with an infinite bound measures without clipping)
        bound = params.grad_clip_norm if params.grad_clip_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, bound))
        with working("optim_step"):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.steps[model_id] += 1
        return {"grad_norm:mean": grad_norm, "step:max": float(self.steps[model_id])}

    def _check_data(self, data: Sequence[Datum]) -> None:
        if not data:
            raise ValueError("data: a request needs at least one datum")
        for i, datum in enumerate(data):
            n = len(datum.tokens)
            if n == 0:
                raise ValueError(f"data[{i}].model_input: empty")
            if self.max_length is not None and n > self.max_length:
                raise ValueError(f"data[{i}].model_input: {n} tokens, over the model's {self.max_length}")
            targets = datum.inputs.get("target_tokens")
            if targets is None:
                raise ValueError(f"data[{i}].loss_fn_inputs: target_tokens is missing")
            if targets.shape[0] != n or targets.ndim not in (1, 2):
                raise ValueError(
                    f"data[{i}].loss_fn_inputs.target_tokens: shape {tuple(targets.shape)}, where the input has {n} tokens"
                )
            ids = torch.cat([torch.as_tensor(datum.tokens, dtype=torch.long), targets.flatten().long()])
            bad = ids[(ids < 0) | (ids >= self.vocab_size)].tolist()
            if bad:
                raise ValueError(f"data[{i}]: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def _batches(self, data: Sequence[Datum]) -> Iterator[list[Datum]]:
        """The data in order, in groups of at most ``max_batch_tokens`` padded tokens."""
        batch: list[Datum] = []
        for datum in data:
            width = max([len(d.tokens) for d in batch] + [len(datum.tokens)])
            if batch and width * (len(batch) + 1) > self.max_batch_tokens:
                yield batch
                batch = []
            batch.append(datum)
        if batch:
            yield batch

    def _target_logprobs(self, batch: Sequence[Datum]) -> list[torch.Tensor]:
        """Each datum's log-probs of its target tokens, ``[N]`` or ``[N, K]``, with their graph:
        position t's distribution is the model's after reading tokens ``0..t``."""
        from rlpost.policies.transformers_wrapper import final_hidden_states, plain_head

        width = max(len(d.tokens) for d in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, datum in enumerate(batch):
            input_ids[i, : len(datum.tokens)] = torch.tensor(datum.tokens)
            attention[i, : len(datum.tokens)] = 1
        inputs = {"input_ids": input_ids, "attention_mask": attention}
        head = plain_head(self.model)
        if head is not None:
            norm, lm_head = head
            hidden = final_hidden_states(self.model, norm, inputs)
        else:
            logprobs_all = torch.log_softmax(self.model(**inputs, use_cache=False).logits.float(), dim=-1)
        result = []
        for i, datum in enumerate(batch):
            n = len(datum.tokens)
            targets = datum.inputs["target_tokens"].long()
            columns = targets.reshape(n, -1)
            if head is not None:
                rows = hidden[i, :n].repeat_interleave(columns.shape[1], dim=0)
                lp = chunked_token_logprobs(rows, lm_head.weight, lm_head.bias, columns.reshape(-1))
            else:
                lp = logprobs_all[i, :n].gather(-1, columns).reshape(-1)
            result.append(lp.reshape(targets.shape))
        return result

    # ---------------------------------------------------------------------------- weights

    def adapter_state(self, model_id: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``(adapter_config.json's content, the adapter's tensors under peft's file names)``: what
        an inference engine loads as a LoRA adapter."""
        from peft import get_peft_model_state_dict

        from rlpost.policies.lora import peft_config_json

        self._spec(model_id)
        config = peft_config_json(self.model.peft_config[model_id], self.base_model)
        tensors = get_peft_model_state_dict(self.model, adapter_name=model_id)
        return config, {name: t.detach().clone().contiguous() for name, t in tensors.items()}

    def save(self, model_id: str, folder: str | Path, *, with_optimizer: bool) -> Path:
        """Write the adapter (a peft adapter folder), and with ``with_optimizer`` its optimizer
        state, to ``folder``."""
        from rlpost.policies.lora import write_adapter

        config, tensors = self.adapter_state(model_id)
        folder = write_adapter(folder, tensors, config)
        meta = {"model_id": model_id, "base_model": self.base_model, "lora": asdict(self.specs[model_id]),
                "step": self.steps[model_id], "optimizer": with_optimizer}  # fmt: skip
        if with_optimizer:
            torch.save(self.optimizers[model_id].state_dict(), Path(folder) / OPTIMIZER_FILE)
        (Path(folder) / MODEL_FILE).write_text(json.dumps(meta, indent=1))
        return Path(folder)

    def load(self, model_id: str, folder: str | Path, *, with_optimizer: bool) -> dict[str, Any]:
        """Set ``model_id``'s adapter (created from the folder's spec when it does not exist) to the
        weights saved in ``folder``, and its optimizer state too with ``with_optimizer`` (else a
        fresh optimizer)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        from rlpost.policies.lora import ADAPTER_WEIGHTS

        folder = Path(folder)
        meta = json.loads((folder / MODEL_FILE).read_text())
        spec = AdapterSpec(**meta["lora"])
        if model_id not in self.specs:
            self.create(model_id, spec)
        elif self._spec(model_id).rank != spec.rank:  # (brought into the model)
            raise ValueError(
                f"path: the saved adapter has rank {spec.rank}, model {model_id!r} rank {self.specs[model_id].rank}"
            )
        result = set_peft_model_state_dict(self.model, load_file(folder / ADAPTER_WEIGHTS), adapter_name=model_id)
        unexpected = [k for k in result.unexpected_keys if model_id in k or "lora_" in k]
        if unexpected:
            raise ValueError(f"path: the saved adapter has tensors this model lacks: {unexpected[:3]}")
        self.optimizers[model_id] = torch.optim.AdamW(self._parameters(model_id), lr=1e-4)
        if with_optimizer:
            if not meta.get("optimizer") or not (folder / OPTIMIZER_FILE).exists():
                raise ValueError(f"path: {folder.name} was saved without its optimizer state")
            self.optimizers[model_id].load_state_dict(torch.load(folder / OPTIMIZER_FILE, weights_only=True))
        self.steps[model_id] = int(meta.get("step", 0))
        return self.info(model_id)

    def snapshot(self, model_id: str, *, with_optimizer: bool) -> dict[str, bytes]:
        """:meth:`save`'s files as bytes (for a caller on another machine to store)."""
        with tempfile.TemporaryDirectory(prefix="rlpost-adapter-") as folder:
            self.save(model_id, folder, with_optimizer=with_optimizer)
            return {path.name: path.read_bytes() for path in Path(folder).iterdir() if path.is_file()}

    def restore(self, model_id: str, files: dict[str, bytes], *, with_optimizer: bool) -> dict[str, Any]:
        """:meth:`load` from :meth:`snapshot`'s files."""
        with tempfile.TemporaryDirectory(prefix="rlpost-adapter-") as folder:
            for name, content in files.items():
                (Path(folder) / Path(name).name).write_bytes(content)
            return self.load(model_id, folder, with_optimizer=with_optimizer)


def _nbytes(value: Any) -> int:
    """The bytes of every tensor in ``value`` (nested dicts and lists)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, list):
        return sum(_nbytes(v) for v in value)
    return 0


def _on_cpu(value: Any) -> Any:
    """A copy of ``value`` (an optimizer's state dict) with every tensor on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_on_cpu(v) for v in value]
    return value


def _linear_layers(model: torch.nn.Module) -> dict[str, set[str]]:
    """The leaf names of the model's linear layers by kind: attention, MLP, output head."""
    kinds: dict[str, set[str]] = {"attn": set(), "mlp": set(), "unembed": set()}
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        parents = name.split(".")[:-1]
        if module is head:
            kinds["unembed"].add(name.rsplit(".", 1)[-1])
        elif any("attn" in p or "attention" in p for p in parents):
            kinds["attn"].add(name.rsplit(".", 1)[-1])
        elif any("mlp" in p or "feed_forward" in p for p in parents):
            kinds["mlp"].add(name.rsplit(".", 1)[-1])
    return kinds


def start_adapter_trainer(base_model: str, *, name: str, resources: Any, namespace: str | None = None,
                          init_kwargs: dict[str, Any] | None = None, **options: Any):  # fmt: skip
    """Start :class:`AdapterTrainer` as the named Ray actor (``init_kwargs`` go to its constructor,
    ``options`` to ``.options()``)."""
    from rlpost.actors import start_actor

    return start_actor(AdapterTrainer, base_model, name=name, resources=resources, namespace=namespace,
                       init_kwargs=init_kwargs, **options)  # fmt: skip
