"""`rlpost serve` as an operator runs it: the command starts its own Ray cluster and fleet, the
tinker SDK trains and samples through it, the node's Prometheus endpoint shows the service's
metrics, `rlpost scale STORAGE_DIR` adds an engine and takes it away, and SIGTERM stops it (exit
143) leaving none of its processes behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(600)]
tinker = pytest.importorskip("tinker", reason="the tinker SDK is in the dev extra")
from tinker import types  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KEY = "tml-operator-0123456789"


def _session_pids(session: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session:
                found.append(int(entry))
    return found


def _read_until(process, pattern: str, timeout_s: float, seen: list[str]) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no line matching {pattern!r}; the command printed:\n{''.join(seen)}")


def test_serve_trains_samples_exports_metrics_and_stops_on_sigterm(tmp_path):
    # Ctrl-C's SIGINT takes the same path (tests/unit/serve/test_server_signals.py); one run here
    stop, code = signal.SIGTERM, 143
    env = {**os.environ, "RLPOST_SERVE_API_KEYS": f"operator={KEY}", "TINKER_TELEMETRY": "0", "PYTHONUNBUFFERED": "1"}
    # (the options after the overrides: argparse reads no positional after an option)
    command = [sys.executable, "-m", "rlpost.ops.cli", "serve", "configs/serve-tiny-cpu.yaml",
               f"storage_dir={tmp_path / 'storage'}", "resources.trainer.num_cpus=0.5",
               "resources.inference.num_cpus=0.5", "inference_workers=1..2", "--port", "0"]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)  # fmt: skip
    seen: list[str] = []
    try:
        metrics_url = _read_until(process, r"metrics at (http://\S+/metrics)", 120, seen).group(1)
        url = _read_until(process, r"the Tinker API on (http://[\d.]+:\d+)", 300, seen).group(1)

        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = client.create_lora_training_client(base_model=str(REPO / "models" / "tiny-model"), rank=8).result()
        tokens = training.get_tokenizer().encode("What is 2 + 2? 4")
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})  # fmt: skip
        assert training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        sample = sampler.sample(types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=3)).result()
        assert len(sample.sequences[0].tokens) == 3
        with pytest.raises(tinker.RequestFailedError, match="unknown loss"):  # a user error, counted
            training.forward_backward([datum], "dpo").result()

        deadline, text = time.monotonic() + 90, ""
        while time.monotonic() < deadline and not ('kind="forward_backward"' in text and "request_errors" in text):
            time.sleep(3)
            text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        assert re.search(r'ray_rlpost_serve_requests_total\{[^}]*kind="forward_backward"[^}]*tenant="operator"', text)
        assert re.search(r"ray_rlpost_serve_tokens_sampled_total\{[^}]*tenant=\"operator\"[^}]*\} 3", text)
        assert re.search(r"ray_rlpost_serve_models\{[^}]*\} 1", text)
        assert re.search(r'ray_rlpost_serve_tenant_pending\{[^}]*tenant="operator"[^}]*\} 0', text)
        assert re.search(r'ray_rlpost_serve_trainer_adapters\{[^}]*where="resident"[^}]*\} 1', text)
        from rlpost.ops import dashboards

        for title, expr in dashboards.panel_queries(dashboards.SERVE_ROWS):  # the service dashboard has data
            for name in re.findall(r"\bray_rlpost_serve_\w+", expr):
                assert re.search(rf"^{name}\{{", text, re.MULTILINE), (title, name)

        # an operator adds an engine and takes it away again, as for a training run
        def scale(*words):
            return subprocess.run([sys.executable, "-m", "rlpost.ops.cli", "scale", str(tmp_path / "storage"), *words],
                                  cwd=REPO, env=env, capture_output=True, text=True, timeout=400)  # fmt: skip

        grown = scale("inference=2", "--wait", "300")
        assert grown.returncode == 0 and "inference workers: 2 serving of 2 wanted" in grown.stdout, grown
        prompt, params = types.ModelInput.from_ints(tokens[:4]), types.SamplingParams(max_tokens=3)
        for _ in range(2):  # one on each engine (the new one gets the adapter on its first use)
            assert len(sampler.sample(prompt, 1, params).result().sequences[0].tokens) == 3
        beyond = scale("inference=3")
        assert beyond.returncode == 2 and "outside the service's range 1..2" in beyond.stderr, beyond
        shrunk = scale("inference=1", "--wait", "120")
        assert shrunk.returncode == 0 and "inference workers: 1 serving of 1 wanted" in shrunk.stdout, shrunk
        assert len(sampler.sample(prompt, 1, params).result().sequences[0].tokens) == 3

        started = time.monotonic()
        process.send_signal(stop)
        exited = process.wait(timeout=120)
        seen += process.stdout.readlines()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = "".join(seen)
    assert exited == code, output
    assert "rlpost serve: stopping the fleet" in output and f"stopped by {stop.name}" in output
    assert time.monotonic() - started < 90
    deadline = time.monotonic() + 30
    while _session_pids(process.pid) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _session_pids(process.pid), "processes of the service outlived it"
