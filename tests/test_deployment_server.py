"""Deployments: prefect.yaml and the scripts in deployments/ against a real Prefect server.

The server test starts `prefect server start` on 127.0.0.1 with its own PREFECT_HOME (SQLite inside
tmp_path), runs deployments/create_pool.sh and deployments/deploy.sh, starts a process worker with
deployments/start_worker.sh, triggers a run of `collect-sft-data` through the REST API and waits for
it to complete; the worker runs the flow from this checkout. Every Prefect setting lives in the
subprocesses' environment only, so the session's `prefect_harness` is never touched; this module talks
to its server with plain HTTP.

The other tests check, without a server, what the UI form and the GPU example rest on: each
deployment's flow signature yields a parameter schema of profile and overrides, its default
parameters validate, the Kubernetes base job template renders a GPU pod manifest, and the RayCluster of
the multi-node deployment offers its ranks, authenticates every Ray process and is fenced by its
NetworkPolicy.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from rubricem_core.store import RunStore

REPO_ROOT = Path(__file__).resolve().parents[1]
POOL = "rubricem-process"
RAY_POOL = "rubricem-ray"  # the process pool whose worker runs in the RayCluster's head pod
FLOW_DEPLOYMENTS = {  # deployment name → entrypoint, one per flow
    "collect-sft-data": "flows/collect_sft_data.py:collect_sft_data",
    "sft": "flows/sft.py:sft",
    "rl": "flows/rl.py:rl",
    "evaluate": "flows/evaluate.py:evaluate",
    "ablation": "flows/ablation.py:ablation",
    "pipeline": "flows/pipeline.py:pipeline",
}
# A world small enough that the flow run is dominated by process start-up: 3 train queries x 2 traces.
TINY = {"data.world.n_documents": 50, "data.world.n_queries": 4, "data.world.eval_fraction": 0.25}
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
LIVE = {"RUNNING", "PENDING", "SCHEDULED", "PAUSED", "CANCELLING"}


def _load_yaml(relative: str) -> dict:
    return yaml.safe_load((REPO_ROOT / relative).read_text())


def _deployments(relative: str = "prefect.yaml") -> dict[str, dict]:
    return {d["name"]: d for d in _load_yaml(relative)["deployments"]}


def _flow(entrypoint: str):
    from prefect.flows import load_flow_from_entrypoint

    return load_flow_from_entrypoint(str(REPO_ROOT / entrypoint))


# --- prefect.yaml without a server ------------------------------------------------------------------


def test_prefect_yaml_has_one_deployment_per_flow_on_the_process_pool():
    spec = _load_yaml("prefect.yaml")
    deployments = _deployments()
    assert {name: d["entrypoint"] for name, d in deployments.items()} == FLOW_DEPLOYMENTS
    for name, d in deployments.items():
        assert d["work_pool"]["name"] == POOL, name
        assert len(d["description"]) > 40, name
        assert set(d["parameters"]) == {"run_dir", "profile"}, name
        assert (REPO_ROOT / "data" / "profiles" / f"{d['parameters']['profile']}.yaml").is_file(), name
    # the step-by-step flows continue one run directory; pipeline and ablation have their own
    run_dirs = {name: d["parameters"]["run_dir"] for name, d in deployments.items()}
    assert len({run_dirs[n] for n in ("collect-sft-data", "sft", "rl", "evaluate")}) == 1
    assert len({run_dirs["collect-sft-data"], run_dirs["pipeline"], run_dirs["ablation"]}) == 3
    # workers run the checkout named by their own environment, resolved at run time
    (step,) = spec["pull"]
    assert step == {"flows.checkout.set_checkout_directory": {"directory": "{{ $RUBRICEM_HOME }}"}}


@pytest.mark.parametrize("home", ["set", "unset"])
def test_the_pull_step_runs_from_rubricem_home_or_the_installed_checkout(tmp_path, monkeypatch, home):
    """What a worker's flow run does first (prefect.yaml's pull step, its `{{ $RUBRICEM_HOME }}` rendered
    from the environment, empty when unset): with RUBRICEM_HOME (start_worker.sh) that checkout; without
    it (a bare `prefect worker start`, as `prefect deploy` suggests) the checkout of the installed package."""
    from flows.checkout import set_checkout_directory

    (step,) = _load_yaml("prefect.yaml")["pull"]
    assert list(step) == ["flows.checkout.set_checkout_directory"]
    other = tmp_path / "checkout"
    other.mkdir()
    (other / "prefect.yaml").write_text("name: rubricem\n")
    monkeypatch.chdir(tmp_path)
    output = set_checkout_directory(str(other) if home == "set" else "")
    expected = (other if home == "set" else REPO_ROOT).resolve()
    assert Path.cwd() == expected and output == {"directory": str(expected)}
    with pytest.raises(FileNotFoundError, match="not a RubricEM checkout"):  # a clear error, not a chdir
        set_checkout_directory(str(tmp_path))
    assert Path.cwd() == expected


@pytest.mark.parametrize("name", list(FLOW_DEPLOYMENTS))
def test_deployment_form_is_profile_and_overrides(name):
    """What `prefect deploy` stores as parameter_openapi_schema: the UI form of the deployment. It asks
    for a profile and overrides only (never a RunConfig pre-filled with built-in defaults that differ
    from the profile it names); the config itself is resolved and recorded in the run directory."""
    from prefect.utilities.callables import parameter_schema

    deployment = _deployments()[name]
    flow = _flow(deployment["entrypoint"])
    schema = parameter_schema(flow).model_dump_for_openapi()
    # the common three first (evaluate adds checkpoint, benchmarks, retrieval after them)
    assert list(schema["properties"])[:3] == ["run_dir", "profile", "overrides"]
    assert "config" not in schema["properties"] and "RunConfig" not in schema.get("definitions", {})
    assert schema["properties"]["overrides"]["default"] is None
    # the form offers the profiles as a dropdown (an enum); a direct call may still name a YAML file
    (choices,) = [a for a in schema["properties"]["profile"]["anyOf"] if "enum" in a]
    assert choices["enum"] == sorted(p.stem for p in (REPO_ROOT / "data" / "profiles").glob("*.yaml"))
    flow.validate_parameters({**deployment["parameters"], "profile": "data/profiles/tiny.yaml"})
    # the deployment's defaults and a form's overrides are valid parameters
    flow.validate_parameters(deployment["parameters"])
    flow.validate_parameters({**deployment["parameters"], "overrides": {"teacher.max_rounds": 6}})


# --- the GPU example without a cluster --------------------------------------------------------------


def test_gpu_job_template_renders_a_gpu_pod_per_deployment(monkeypatch):
    from prefect.server.schemas.actions import validate_base_job_template
    from prefect.utilities.schema_tools import ValidationError, validate
    from prefect.utilities.templating import apply_values

    template = json.loads((REPO_ROOT / "deployments" / "gpu" / "base-job-template.json").read_text())
    validate_base_job_template(template)  # every placeholder is a declared variable (the server's check)
    variables = template["variables"]
    defaults = {k: v["default"] for k, v in variables["properties"].items() if "default" in v}
    validate(defaults, variables, raise_on_error=True, ignore_required=True)

    gpu_deployments = _deployments("deployments/gpu/prefect-gpu.yaml")
    assert {d["entrypoint"] for d in gpu_deployments.values()} <= set(FLOW_DEPLOYMENTS.values())
    image = "registry.example.com/rubricem:gpu"
    monkeypatch.setenv("RUBRICEM_IMAGE", image)  # deployments/gpu/deploy.sh requires it
    pods = {}
    for name, d in gpu_deployments.items():
        if d["work_pool"]["name"] == RAY_POOL:
            continue  # test_raycluster_matches_the_multinode_deployment
        assert d["work_pool"]["name"] == "rubricem-gpu" and d["parameters"]["profile"] == "gpu", name
        job_variables = apply_values(
            d["work_pool"]["job_variables"], {}
        )  # as `prefect deploy`: {{ $VAR }} from os.environ
        validate(job_variables, variables, raise_on_error=True, ignore_required=True)
        rendered = apply_values(template["job_configuration"], {**defaults, **job_variables})
        pods[name] = rendered["job_manifest"]["spec"]["template"]["spec"]
    trainer = pods["rl-gpu"]["containers"][0]
    assert trainer["image"] == image
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "dshm", "mountPath": "/dev/shm"} in trainer["volumeMounts"]
    assert pods["rl-gpu"]["tolerations"] and pods["rl-gpu"]["nodeSelector"]
    teacher = pods["collect-sft-data-gpu"]
    assert teacher["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 0
    assert teacher["nodeSelector"] == {} and teacher["tolerations"] == []
    assert pods["evaluate-gpu"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == 1
    with pytest.raises(ValidationError):
        validate({"gpus": "eight"}, variables, raise_on_error=True, ignore_required=True)


def _ray_cluster() -> dict:
    return _load_yaml("deployments/gpu/raycluster.yaml")


def _groups(cluster: dict) -> list[tuple[dict, int]]:
    """(group spec, pods) for the head group and each worker group."""
    spec = cluster["spec"]
    return [(spec["headGroupSpec"], 1), *[(g, g["replicas"]) for g in spec["workerGroupSpecs"]]]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _driver(cluster: dict) -> dict:
    """The head pod's container that runs the Prefect worker of the Ray pool (its flow runs: the drivers)."""
    (driver,) = [
        c
        for c in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
        if c.get("command", [])[:3] == ["prefect", "worker", "start"]
    ]
    return driver


def test_raycluster_matches_the_multinode_deployment():
    """raycluster.yaml offers exactly the trainer ranks the 2-node deployment asks Ray to place, one GPU
    each, on as many nodes as it names; the head pod's Prefect worker serves the deployment's pool, and
    its flow runs join that Ray (RAY_ADDRESS=auto) with the fleet on the worker container's own GPUs."""
    import ray

    from rubricem_core.config import load_config

    cluster = _ray_cluster()
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    # the image installs the Ray the project pins; KubeRay reads rayVersion to render the pods
    assert cluster["spec"]["rayVersion"] == ray.__version__
    assert f"ray[default]=={ray.__version__}" in (REPO_ROOT / "deployments" / "gpu" / "Dockerfile").read_text()

    (d,) = [d for d in _deployments("deployments/gpu/prefect-gpu.yaml").values() if d["work_pool"]["name"] == RAY_POOL]
    assert d["name"] == "pipeline-gpu-2nodes" and d["entrypoint"] == FLOW_DEPLOYMENTS["pipeline"]
    cfg = load_config(d["parameters"]["profile"], d["parameters"]["overrides"])
    assert cfg.distributed.ray_address == "auto"

    ray_gpus, pods = 0, 0
    for group, replicas in _groups(cluster):
        ray_container = group["template"]["spec"]["containers"][0]  # KubeRay starts Ray in the first one
        assert ray_container["name"].startswith("ray-")
        gpus = ray_container["resources"]["limits"]["nvidia.com/gpu"]
        assert (
            int(group["rayStartParams"]["num-gpus"]) == gpus == ray_container["resources"]["requests"]["nvidia.com/gpu"]
        )
        ray_gpus += gpus * replicas
        pods += replicas
        if replicas != 1 or group is not cluster["spec"]["headGroupSpec"]:
            assert group["minReplicas"] == group["maxReplicas"] == group["replicas"]  # a fixed cluster
    assert not cluster["spec"].get("enableInTreeAutoscaling")
    assert pods == cfg.distributed.nnodes == 2
    assert ray_gpus == cfg.distributed.nnodes * cfg.distributed.nproc_per_node == cfg.distributed.world_size

    driver = _driver(cluster)
    assert driver["command"] == ["prefect", "worker", "start", "--pool", RAY_POOL, "--type", "process"]
    assert _env(driver)["RAY_ADDRESS"]["value"] == "auto"
    assert _env(driver)["PREFECT_API_URL"]["valueFrom"]["secretKeyRef"]  # never a URL written in the manifest
    # the rollout fleet runs beside the driver, on the driver container's own GPUs
    fleet = cfg.rollout.replicas * cfg.rollout.tensor_parallel_size
    assert cfg.rollout.engine == "vllm_server"
    assert driver["resources"]["limits"]["nvidia.com/gpu"] == fleet
    assert sorted(cfg.rollout.devices) == list(range(fleet))
    # 2 × 8 GPUs in all
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert sum(c["resources"]["limits"].get("nvidia.com/gpu", 0) for c in head) == 8
    assert [
        g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        for g in cluster["spec"]["workerGroupSpecs"]
    ] == [8]


def test_raycluster_authenticates_every_ray_process_and_keeps_the_dashboard_inside():
    cluster = _ray_cluster()
    head = cluster["spec"]["headGroupSpec"]
    secrets = set()
    for group, _ in _groups(cluster):
        pod = group["template"]["spec"]
        assert pod["containers"], group
        for container in pod["containers"]:  # Ray's containers and the driver's: one token, from a Secret
            env = _env(container)
            assert env["RAY_AUTH_MODE"]["value"] == "token", container["name"]
            ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert not ref.get("optional"), container["name"]  # a missing Secret stops the pod, not the auth
            secrets.add((ref["name"], ref["key"]))
            assert env["RAY_USAGE_STATS_ENABLED"]["value"] == "0"
            assert "value" not in env["RAY_AUTH_TOKEN"]
            # the same run directories at the same path everywhere: ranks write logs and shards the driver reads
            runs = [m for m in container["volumeMounts"] if m["name"] == "runs"]
            assert runs == [{"name": "runs", "mountPath": "/opt/rubricem/runs"}], container["name"]
            assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
        assert claims["runs"] == "rubricem-runs"
        assert group["rayStartParams"]["disable-usage-stats"] == "true"
    assert secrets == {("rubricem-ray-token", "auth_token")}
    # the dashboard listens on the head pod's loopback (or not at all); no Service type reaches outside
    params = head["rayStartParams"]
    assert params.get("dashboard-host") == "127.0.0.1" or params.get("include-dashboard") == "false"
    assert head["serviceType"] == "ClusterIP"
    ports = [p for c in head["template"]["spec"]["containers"] for p in c.get("ports", [])]
    assert all(p["containerPort"] != 8265 and "dashboard" not in p.get("name", "") for p in ports), ports
    # the driver finds the head's session (RAY_ADDRESS=auto) and object store through shared volumes
    for path in ("/tmp/ray", "/dev/shm"):
        names = {
            m["name"]
            for c in head["template"]["spec"]["containers"]
            for m in c["volumeMounts"]
            if m["mountPath"] == path
        }
        assert len(names) == 1, (path, names)


def test_networkpolicy_admits_only_the_clusters_own_pods():
    cluster = _ray_cluster()
    policy = _load_yaml("deployments/gpu/networkpolicy.yaml")
    assert policy["kind"] == "NetworkPolicy" and policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"]["namespace"] == cluster["metadata"]["namespace"]
    own = {"ray.io/cluster": cluster["metadata"]["name"]}  # the label KubeRay puts on every pod of the cluster
    assert policy["spec"]["podSelector"] == {"matchLabels": own}
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    # every ingress rule names peers, and each peer is a pod of this cluster (no ipBlock, no other namespace)
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), rule  # an empty from admits everyone
        assert all(peer == {"podSelector": {"matchLabels": own}} for peer in rule["from"]), rule
    egress = policy["spec"]["egress"]
    assert {"to": [{"podSelector": {"matchLabels": own}}]} in egress
    ports = {p["port"] for rule in egress for p in rule.get("ports", [])}
    assert {53, 4200, 443} <= ports  # DNS, the Prefect API, the LLM providers


def _stand_in_kubectl(tmp_path: Path, secret_exists: bool) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> "{tmp_path}/calls"\n'
        'case "$*" in\n'
        f'  *"get secret"*) exit {0 if secret_exists else 1} ;;\n'
        f'  *"apply -f -"*) cat > "{tmp_path}/applied.yaml" ;;\n'
        "esac\n"
    )
    (bin_dir / "kubectl").chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "RUBRICEM_IMAGE": "registry.example.com/rubricem:gpu"}


def test_apply_cluster_sets_the_image_and_applies_the_policy_first(tmp_path):
    env = _stand_in_kubectl(tmp_path, secret_exists=True)
    script = str(REPO_ROOT / "deployments" / "gpu" / "apply_cluster.sh")
    subprocess.run(["bash", script], check=True, env=env, capture_output=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == [
        "-n rubricem get secret rubricem-ray-token",
        "-n rubricem apply -f networkpolicy.yaml",
        "-n rubricem apply -f -",
    ]
    applied = yaml.safe_load((tmp_path / "applied.yaml").read_text())
    images = [c["image"] for group, _ in _groups(applied) for c in group["template"]["spec"]["containers"]]
    assert len(images) == 3 and set(images) == {env["RUBRICEM_IMAGE"]}
    assert {**applied, "spec": None} == {**_ray_cluster(), "spec": None}

    # without the token's Secret (or the image) nothing is applied
    (tmp_path / "no-secret").mkdir()
    env = _stand_in_kubectl(tmp_path / "no-secret", secret_exists=False)
    refused = subprocess.run(["bash", script], env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "rubricem-ray-token" in refused.stderr
    assert (tmp_path / "no-secret" / "calls").read_text().splitlines() == ["-n rubricem get secret rubricem-ray-token"]
    no_image = subprocess.run(["bash", script], env={**env, "RUBRICEM_IMAGE": ""}, capture_output=True, text=True)
    assert no_image.returncode == 2 and "RUBRICEM_IMAGE" in no_image.stderr


# --- a real server, the scripts, a worker ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Background:
    """A subprocess in its own session with output to a log file; stop() ends it and its descendants."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            args, cwd=REPO_ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        # flow-run processes of a worker may sit in their own process group: end every descendant;
        # psutil checks each process's start time, so a recycled pid is never signalled
        try:
            root = psutil.Process(self.proc.pid)
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        for process in family:
            try:
                process.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(family, timeout=15)
        for process in alive:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        self.proc.wait(timeout=5)
        self._out.close()


class _Api:
    """Plain HTTP to the test server. A 503 is SQLite busy under load: retried, as Prefect's client does."""

    def __init__(self, url: str):
        self._client = httpx.Client(base_url=url, timeout=30)

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        for attempt in range(8):
            response = self._client.request(method, path, **kwargs)
            if response.status_code != 503:
                break
            time.sleep(0.25 * 2 ** min(attempt, 4))
        return response

    def get(self, path: str) -> httpx.Response:
        return self.request("GET", path)

    def post(self, path: str, json: dict) -> httpx.Response:
        return self.request("POST", path, json=json)


def _wait_terminal(api: _Api, flow_run_id: str, worker: _Background, seconds: float = 300) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        flow_run = api.get(f"/flow_runs/{flow_run_id}").json()
        state = flow_run["state"]["type"]
        if state in TERMINAL:
            return flow_run
        assert worker.proc.poll() is None, f"worker exited:\n{worker.tail()}"
        assert time.monotonic() < deadline, f"flow run still {state} after {seconds} s:\n{worker.tail()}"
        time.sleep(1)


def _task_runs(api: _Api, flow_run_ids: list[str]) -> list[dict]:
    return api.post(
        "/task_runs/filter", json={"flow_runs": {"id": {"any_": flow_run_ids}}, "sort": "EXPECTED_START_TIME_ASC"}
    ).json()


def _newest_by_name(task_runs: list[dict]) -> dict[str, dict]:
    """The latest task run of each name (a retried flow run holds its first attempt's task runs too)."""
    out: dict[str, dict] = {}
    for t in sorted(task_runs, key=lambda t: t["created"]):
        out[t["name"]] = t
    return out


def _run(args: list[str], env: dict[str, str], timeout: float = 240) -> str:
    done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(args)} failed ({done.returncode}):\n{output[-4000:]}"
    return output


@pytest.fixture()
def prefect_server(tmp_path):
    """`prefect server start` on a free port of 127.0.0.1, with everything under tmp_path."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            "PREFECT_HOME": str(tmp_path / "prefect-home"),  # its SQLite database and profiles
            "PREFECT_API_URL": url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",  # the API is what is tested; the UI build only slows start-up
            "PREFECT_WORKER_QUERY_SECONDS": "1",  # the worker polls every second instead of every 10
        }
    )
    server = _Background(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env,
        tmp_path / "server.log",
    )
    try:
        t0 = time.monotonic()
        deadline = t0 + 150
        while True:
            assert server.proc.poll() is None, f"prefect server exited:\n{server.tail()}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"prefect server not healthy after 150 s:\n{server.tail()}"
            time.sleep(0.5)
        print(f"prefect server healthy after {time.monotonic() - t0:.0f} s")
        yield url, env
    finally:
        server.stop()


def _check_gpu_pool_on_the_server(api: _Api) -> None:
    """The server accepts the Kubernetes template and validates the GPU deployments' job variables
    against it (what create_pool.sh and `prefect deploy` send, minus the CLI start-up); the multi-node
    deployment goes to the process pool of the RayCluster's head pod."""
    template = json.loads((REPO_ROOT / "deployments" / "gpu" / "base-job-template.json").read_text())
    pool = api.post("/work_pools/", json={"name": "rubricem-gpu", "type": "kubernetes", "base_job_template": template})
    assert pool.status_code == 201, pool.text
    ray_pool = api.post("/work_pools/", json={"name": RAY_POOL, "type": "process"})
    assert ray_pool.status_code == 201, ray_pool.text
    flow_id = api.post("/flows/", json={"name": "rl"}).json()["id"]
    for name, d in _deployments("deployments/gpu/prefect-gpu.yaml").items():
        job_variables = d["work_pool"].get("job_variables", {})
        if d["work_pool"]["name"] == "rubricem-gpu":
            job_variables = {**job_variables, "image": "registry.example.com/rubricem:gpu"}
        created = api.post(
            "/deployments/",
            json={
                "name": name,
                "flow_id": flow_id,
                "work_pool_name": d["work_pool"]["name"],
                "job_variables": job_variables,
                "parameters": d["parameters"],
            },
        )
        assert created.status_code in (200, 201), f"{name}: {created.text}"
    refused = api.post(
        "/deployments/",
        json={"name": "bad", "flow_id": flow_id, "work_pool_name": "rubricem-gpu", "job_variables": {"gpus": "eight"}},
    )
    assert refused.status_code == 422 and "gpus" in refused.text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deploy_and_run_through_the_api(prefect_server, tmp_path):
    url, env = prefect_server
    api = _Api(url)
    started = time.monotonic()
    # the worker starts first (its start-up overlaps the deploy); it may create the pool itself, which
    # deploy.sh's create_pool.sh must then accept
    worker = _Background(["bash", "deployments/start_worker.sh"], env, tmp_path / "worker.log")
    try:
        _run(["bash", "deployments/deploy.sh", "collect-sft-data", "pipeline"], env)
        print(f"deployed after {time.monotonic() - started:.0f} s")
        assert api.get(f"/work_pools/{POOL}").json()["type"] == "process"
        deployment = api.get("/deployments/name/collect_sft_data/collect-sft-data").json()
        assert deployment["work_pool_name"] == POOL
        assert deployment["parameters"] == {"run_dir": "runs/ui", "profile": "tiny"}
        assert deployment["description"].startswith("SFT data collection")
        form = deployment["parameter_openapi_schema"]
        assert list(form["properties"]) == ["run_dir", "profile", "overrides"]  # no RunConfig of built-in defaults
        assert (tmp_path / "prefect-home" / "prefect.db").is_file()  # the server's own database

        run_dir = tmp_path / "run"
        created = api.post(
            f"/deployments/{deployment['id']}/create_flow_run",
            json={"parameters": {"run_dir": str(run_dir), "overrides": TINY}},
        )
        assert created.status_code == 201, created.text
        flow_run = created.json()
        # the deployment's defaults fill what the run does not set
        assert flow_run["parameters"]["profile"] == "tiny" and flow_run["parameters"]["overrides"] == TINY

        # creating the pool again keeps it (idempotent); this runs while the worker picks the run up
        assert f"work pool '{POOL}' exists" in _run(["bash", "deployments/create_pool.sh"], env)
        _check_gpu_pool_on_the_server(api)

        flow_run = _wait_terminal(api, flow_run["id"], worker)
        state = flow_run["state"]["type"]
        assert state == "COMPLETED", f"flow run ended {state}: {flow_run['state']['message']}\n{worker.tail()}"
        print(f"flow run completed after {time.monotonic() - started:.0f} s")
        first = {name: t["state"]["name"] for name, t in _newest_by_name(_task_runs(api, [flow_run["id"]])).items()}
        assert first and "Cached" not in first.values(), first  # the first run computed everything

        # the UI's Retry: the same flow run again; what its Parquet already holds ends Cached
        retried = api.post(
            f"/flow_runs/{flow_run['id']}/set_state",
            json={
                "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"},
                "force": True,
            },
        )
        assert retried.status_code in (200, 201), retried.text
        retry = _wait_terminal(api, flow_run["id"], worker)
        assert retry["state"]["type"] == "COMPLETED" and retry["run_count"] == 2, retry["state"]
        # (the retry's task runs are the first run's, by their task keys: their newest state is the retry's)
        states = {name: t["state"]["name"] for name, t in _newest_by_name(_task_runs(api, [flow_run["id"]])).items()}
        rounds = [name for name in states if name.startswith("teacher-round-")]
        assert rounds and all(states[name] == "Cached" for name in rounds), states
        assert states.get("prepare-inputs") == "Cached", states
        assert states.get("filter-trajectories") == "Completed", states  # it always recomputes: never Cached
        print(f"retry completed after {time.monotonic() - started:.0f} s")

        _check_a_killed_pipeline_ends_its_subflows(api, worker, tmp_path / "killed")
    finally:
        worker.stop()

    # what the UI shows of the run: its name, readable task run names, the Markdown summary
    assert flow_run["name"] == f"collect_sft_data · {run_dir}"
    tasks = api.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run["id"]]}}}).json()
    names = {t["name"] for t in tasks}
    assert {"teacher-round-0", "teacher-round-1"} <= names, names
    artifacts = api.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}}).json()
    summaries = [a for a in artifacts if a["type"] == "markdown"]
    assert len(summaries) == 2 and len({a["key"] for a in summaries}) == 1  # one version per attempt, one key
    for summary in summaries:
        assert summary["key"].startswith("collect-sft-data-run-")
        assert "accepted" in summary["data"] and "Reject codes" in summary["data"]
        # its MLflow link opens the model-training view, not MLflow's GenAI default
        links = re.findall(r"https?://[^\s)\]]+/#/experiments[^\s)\]]*", summary["data"])
        assert links and all(link.endswith("?workflowType=machine_learning") for link in links), links

    rows = RunStore(str(run_dir)).read_rows("sft_trajectories")
    assert len(rows) == 3 * 2  # 3 train queries x trajectories_per_query 2 of the tiny profile
    assert sum(r["accepted"] for r in rows) >= 3
    assert (run_dir / "config.yaml").is_file()
    # the flow ran in a process the worker started, not in this one
    assert flow_run["infrastructure_pid"] and not flow_run["infrastructure_pid"].endswith(f":{os.getpid()}")


def _check_a_killed_pipeline_ends_its_subflows(api: _Api, worker: _Background, run_dir: Path) -> None:
    """A pipeline run SIGKILLed inside its collect_sft_data subflow (a fault point set through the run's
    job variables): the worker marks the pipeline run Crashed and runs its crash hook, which ends the
    subflow and its task run Crashed too — without another run of the run directory — and the
    pipeline run's log names the signal."""
    deployment = api.get("/deployments/name/pipeline/pipeline").json()
    created = api.post(
        f"/deployments/{deployment['id']}/create_flow_run",
        json={
            "parameters": {"run_dir": str(run_dir), "overrides": TINY},
            "job_variables": {"env": {"RUBRICEM_FAULT_POINT": "collect.round_written:1"}},
        },
    )
    assert created.status_code == 201, created.text
    top = _wait_terminal(api, created.json()["id"], worker)
    assert top["state"]["type"] == "CRASHED", top["state"]
    assert top["name"] == f"pipeline · {run_dir}"
    deadline = time.monotonic() + 60  # the hook runs in the worker right after it marks the run Crashed
    while True:
        subflows = api.post(
            "/flow_runs/filter", json={"flow_runs": {"parent_flow_run_id": {"any_": [top["id"]]}}}
        ).json()
        tasks = _task_runs(api, [top["id"], *[f["id"] for f in subflows]])
        if subflows and all(r["state"]["type"] not in LIVE for r in subflows + tasks):
            break
        assert time.monotonic() < deadline, (
            f"still live: {[(r['name'], r['state']['type']) for r in subflows + tasks]}\n{worker.tail()}"
        )
        time.sleep(1)
    assert [f["name"] for f in subflows] == [f"collect_sft_data · {run_dir}"]
    assert subflows[0]["state"]["type"] == "CRASHED"
    assert {t["name"]: t["state"]["type"] for t in tasks}["teacher-round-0"] == "CRASHED"  # it was running
    assert "crashed" in subflows[0]["state"]["message"] and "SIGKILL" in subflows[0]["state"]["message"]
    deadline = time.monotonic() + 30  # logs reach the API in batches
    while True:
        logs = api.post("/logs/filter", json={"logs": {"flow_run_id": {"any_": [top["id"]]}}}).json()
        if any("killed by signal SIGKILL" in log["message"] for log in logs):
            break
        assert time.monotonic() < deadline, [log["message"] for log in logs][-10:]
        time.sleep(1)
