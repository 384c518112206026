"""Methods mixed into vLLM's worker process (``worker_extension_cls``) for weight updates.

vLLM's worker process holds the weights, so it is the weight-bus rank: it receives buckets and
reloads them in place with ``model_runner.reload_weights`` (trap: on the CPU backend repacked
linear layers make ``model.load_weights`` fail after start-up), or straight into the CPU kernels
(:mod:`rlpost.policies.cpu_reload`, ``rollout.engine.direct_reload``). An update meeting a
running generate call is received on a thread (``rlpost_begin_receive``) while the engine steps,
then loaded between two steps (``rlpost_finish_receive``). Reached with
``llm.collective_rpc("rlpost_...", args=...)``; arguments are plain data.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


def _drop_layers_left_out(record: logging.LogRecord) -> bool:
    """False for vLLM's warnings about layers an update left out (see ``_rlpost_reload_weights``)."""
    message = str(record.msg)
    return not (message.endswith("Failed to load weights") or message.startswith("Following weights were not loaded"))


class WeightSyncExtension:
    """Bus receiver + in-place weight reload, running inside each vLLM worker."""

    def rlpost_join_bus(self, spec: dict, rank: int) -> int:
        """Join (or re-join, after a reform) the weight bus as ``rank``; returns the rank."""
        from rlpost.transport.bus_receiver import TorchWeightReceiver
        from rlpost.transport.bus_types import BusSpec

        bus_spec = BusSpec(**spec)
        receiver = getattr(self, "_rlpost_receiver", None)
        if receiver is None:
            self._rlpost_receiver = TorchWeightReceiver(bus_spec, rank)
        else:
            receiver.reform(bus_spec, rank)
        return rank

    def rlpost_receive_weights(self, timeout_s: float, overlap: bool = True, direct: bool = False) -> dict:
        """Receive the next update and load each bucket as soon as it is in; returns version,
        ``receive_s`` (waiting for buckets) and ``load_s`` (the rest). ``overlap=False``: receive
        whole, then load (``bench/bench_lora.py``'s baseline). ``direct`` (CPU):
        :class:`~rlpost.policies.cpu_reload.DirectCpuReload` where it knows the model and update;
        it takes every tensor before writing any, so it waits for the last bucket."""
        loader = self._rlpost_direct_loader() if direct else None
        if not overlap:
            start = time.perf_counter()
            version, tensors = self._rlpost_receiver.receive(timeout_s)
            received = time.perf_counter()
            self._rlpost_reload(list(tensors.items()), loader)
            return {"version": version, "receive_s": received - start, "load_s": time.perf_counter() - received,
                    "num_tensors": len(tensors)}  # fmt: skip
        waited, count = [0.0], [0]

        def timed(tensors):
            while True:
                start = time.perf_counter()
                item = next(tensors, None)
                waited[0] += time.perf_counter() - start
                if item is None:
                    return
                count[0] += 1
                yield item

        loading = [0.0]

        def load(version: int, tensors) -> None:
            start = time.perf_counter()
            if loader is not None:  # the views stay valid until this returns
                self._rlpost_reload(list(timed(tensors)), loader)
            else:
                self._rlpost_reload_weights(timed(tensors))
            loading[0] = time.perf_counter() - start

        start = time.perf_counter()
        version = self._rlpost_receiver.receive_streamed(load, timeout_s)
        total = time.perf_counter() - start
        load_s = loading[0] - waited[0]
        return {"version": version, "receive_s": total - load_s, "load_s": load_s, "num_tensors": count[0]}

    def rlpost_begin_receive(self, timeout_s: float) -> None:
        """Start receiving the next update on a thread and return at once (an in-flight update);
        :meth:`rlpost_finish_receive` loads it once :meth:`rlpost_receive_state` says "arrived".
        The receive and the wait for the load are each bounded by ``timeout_s``."""
        abandoned = getattr(self, "_rlpost_incoming", None)
        if abandoned is not None:  # its generate call failed or timed out before loading it
            if not abandoned.arrived.is_set():  # it still reads from the bus: one receive at a time
                raise RuntimeError("rlpost: the update before is still being received")
            abandoned.abandon()
        self._rlpost_incoming = _BackgroundReceive(self._rlpost_receiver, timeout_s)

    def rlpost_receive_state(self) -> str:
        """The update :meth:`rlpost_begin_receive` started: "receiving", "arrived" (every tensor
        is in, or the receive failed: finishing it says which) or "none"."""
        incoming = getattr(self, "_rlpost_incoming", None)
        if incoming is None:
            return "none"
        return "arrived" if incoming.arrived.is_set() else "receiving"

    def rlpost_finish_receive(self, direct: bool = False) -> dict:
        """Load the update :meth:`rlpost_begin_receive` received (waiting for its last bytes if
        need be) as :meth:`rlpost_receive_weights` would; returns version and timings:
        ``receive_s`` from the start of the receive to its last bytes, ``load_s`` the load."""
        incoming, self._rlpost_incoming = getattr(self, "_rlpost_incoming", None), None
        if incoming is None:
            raise RuntimeError("rlpost: no update is being received")
        loader = self._rlpost_direct_loader() if direct else None
        start = time.perf_counter()
        count = incoming.load(lambda named: self._rlpost_reload(named, loader))
        return {"version": incoming.version, "receive_s": incoming.receive_s, "load_s": time.perf_counter() - start,
                "num_tensors": count}  # fmt: skip

    def rlpost_receive_adapter(self, timeout_s: float, folder: str, adapter_config: dict) -> dict:
        """Receive the next update, a LoRA adapter's tensors, and write it as an adapter folder
        (``folder``) that the engine then loads as a LoRA adapter; returns version and timings."""
        from rlpost.policies.lora import write_adapter

        start = time.perf_counter()
        version, tensors = self._rlpost_receiver.receive(timeout_s)
        received = time.perf_counter()
        write_adapter(folder, tensors, adapter_config)
        return {
            "version": version,
            "receive_s": received - start,
            "load_s": time.perf_counter() - received,
            "num_tensors": len(tensors),
        }

    def rlpost_load_weights(self, named_tensors: list, direct: bool = False) -> int:
        """Load weights handed over directly (tests, single-process use); returns the tensor count."""
        self._rlpost_reload(list(named_tensors), self._rlpost_direct_loader() if direct else None)
        return len(named_tensors)

    def rlpost_direct_reload_status(self) -> str | None:
        """Why this engine's updates go through reload_weights (None: the direct reload loads them)."""
        self._rlpost_direct_loader()
        return self._rlpost_direct_reason

    def _rlpost_reload(self, named: list, loader=None) -> None:
        """Load ``named`` (name, tensor) pairs: with ``loader`` (a DirectCpuReload) straight into
        the kernels when it can place every name, else through reload_weights."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            plan = loader.plan(name for name, _ in named) if loader is not None else None
            if isinstance(plan, dict):
                loader.load(named, plan)
                return
            if plan is not None and not getattr(self, "_rlpost_plan_warned", False):
                self._rlpost_plan_warned = True
                logger.warning("rlpost: this update goes through vLLM's reload_weights: %s", plan)
        self._rlpost_reload_weights(iter(named))

    def _rlpost_reload_weights(self, tensors) -> None:
        """vLLM's in-place ``reload_weights`` of the (name, tensor) pairs ``tensors``.

        A LoRA run's merged sync leaves out the frozen embeddings, head and norms on purpose; vLLM
        keeps them and warns "Failed to load weights" at every sync, which is dropped here. The
        run's probe (``sync_logprob_diff``) checks the engine computes what the learner does."""
        names = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")
        loggers = [logging.getLogger(name) for name in names]
        for each in loggers:
            each.addFilter(_drop_layers_left_out)
        try:  # Worker.reload_weights sets the current vLLM config around model_runner.reload_weights
            self.reload_weights(weights_iterator=tensors)
        finally:
            for each in loggers:
                each.removeFilter(_drop_layers_left_out)

    def _rlpost_direct_loader(self):
        """The engine's DirectCpuReload, made on first use; None on GPU or for a model it does
        not know (the reason logged once, and kept for ``rlpost_direct_reload_status``)."""
        if hasattr(self, "_rlpost_direct"):
            return self._rlpost_direct
        from vllm.config import set_current_vllm_config
        from vllm.platforms import current_platform

        from rlpost.policies.cpu_reload import DirectCpuReload, unsupported_reason

        self._rlpost_direct, self._rlpost_direct_reason = None, "not a CPU engine"
        if current_platform.is_cpu():
            model = self.model_runner.get_model()
            with set_current_vllm_config(self.vllm_config):
                self._rlpost_direct_reason = unsupported_reason(model)
            if self._rlpost_direct_reason is None:
                self._rlpost_direct = DirectCpuReload(model)
            else:
                logger.warning("rlpost: weight updates go through vLLM's reload_weights: %s",
                               self._rlpost_direct_reason)  # fmt: skip
        return self._rlpost_direct

    def rlpost_spin_after_work(self, seconds: float) -> int:
        """Bound how long this process busy-polls for the engine's next step after one ends.

        Trap: vLLM's worker spins (``sched_yield``) on its input queue for a second after every
        step; once generation is over that burns a core (0.92 CPU-s measured) beside whatever
        runs next. Returns how many queue readers were changed."""
        import gc

        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        # type(), not isinstance(): gc also lists weak proxies, which raise once their target is gone
        readers = [obj for obj in gc.get_objects() if type(obj) is SpinCondition and obj.is_reader]
        for reader in readers:
            reader.busy_loop_s = seconds
        return len(readers)


class _BackgroundReceive:
    """One update received on a thread of the worker process, its tensors (views valid until the
    receive confirms) held until the main thread's :meth:`load`; only then does the receive
    confirm to the publisher, and a failed load fails the update on the bus too."""

    def __init__(self, receiver, timeout_s: float):
        self.timeout_s = timeout_s
        self.arrived = threading.Event()  # every tensor is in, or the receive failed
        self._loaded = threading.Event()  # the main thread is done with the tensors
        self.version: int | None = None
        self.receive_s = 0.0
        self._named: list | None = None
        self._error: BaseException | None = None
        self._load_error: BaseException | None = None
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(receiver,), name="rlpost-receive", daemon=True)
        self._thread.start()

    def _run(self, receiver) -> None:
        try:
            receiver.receive_streamed(self._hold, self.timeout_s)
        except BaseException as exc:
            self._error = exc
        finally:
            self.arrived.set()

    def _hold(self, version: int, tensors) -> None:
        self.version, self._named = version, list(tensors)
        self.receive_s = time.perf_counter() - self._start
        self.arrived.set()
        if not self._loaded.wait(self.timeout_s):
            raise TimeoutError(f"the engine did not load version {version} within {self.timeout_s}s of its arrival")
        if self._load_error is not None:
            raise self._load_error

    def abandon(self) -> None:
        """Give an update that arrived up unloaded: its receive fails (the publisher is told)
        and its thread, which only waited for the load, ends."""
        self._load_error = RuntimeError(f"rlpost: version {self.version} was received but never loaded")
        self._named = None
        self._loaded.set()
        self._thread.join(self.timeout_s + 30)

    def load(self, reload: Callable[[list], None]) -> int:
        """Wait for the update's last bytes, ``reload`` its (name, tensor) pairs, let the receive
        confirm it; returns the tensor count. Raises the receive's error, or the load's."""
        bound = self.timeout_s + 30  # past the receive's own timeouts, so that their errors come first
        if not self.arrived.wait(bound):
            raise TimeoutError(f"rlpost: the update being received did not arrive within {bound:.0f}s")
        named, self._named = self._named, None
        count = 0 if named is None else len(named)
        try:
            if named is not None:
                reload(named)
        except BaseException as exc:
            self._load_error = exc
            raise
        finally:
            named = None  # the views of the received memory: dropped before the receive confirms
            self._loaded.set()
            self._thread.join(bound)
        if self._thread.is_alive():
            raise TimeoutError(f"rlpost: the receive of version {self.version} did not confirm it within {bound:.0f}s")
        if self._error is not None:
            raise self._error
        return count
