"""deploy/: every kustomization renders, every object is valid, and the pieces are wired to each other
and to the real server.

- ``kubectl kustomize`` renders the cpu and gpu overlays, the RayJob variant, and an overlay with the
  optional monitoring component;
- built-in kinds validate against the Kubernetes schemas bundled in kubernetes-validate (strict: an
  unknown field fails), KubeRay kinds against the CRDs in ``../shared/kuberay-crds`` (strict too: every
  object schema refuses fields it does not declare, as ``kubectl apply --validate=strict`` would);
- wiring: the control plane's command line parses with the real ``sbpflow`` parser, and its ports, store,
  Ray address, secrets, probes and scrape annotations agree with the Service, the PVC, the RayCluster's
  head service and the server's real HTTP routes (probed on a live control plane, without a token, as the
  kubelet calls them); images, users and Ray versions agree with the Dockerfiles.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import shutil
import subprocess
import urllib.error
import urllib.request
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from sbpflow.client.cli.main import build_parser
from sbpflow.control_plane.status.auth import OPEN_HTTP_PATHS
from sbpflow.runs.options import MANAGER_DEFAULTS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"


def _find_crds() -> Path | None:
    """The KubeRay CRD schemas: $SBPFLOW_KUBERAY_CRDS, else ``shared/kuberay-crds`` beside the checkout or
    beside a folder above it (test data the project does not copy)."""
    env = os.environ.get("SBPFLOW_KUBERAY_CRDS")
    candidates = [Path(env)] if env else [p / "shared" / "kuberay-crds" for p in ROOT.parents]
    return next((c for c in candidates if (c / "ray.io_rayclusters.yaml").is_file()), None)


CRDS = _find_crds()
NO_CRDS = (
    "the KubeRay CRD schemas (shared/kuberay-crds beside the checkout) are not here, so RayCluster/RayJob "
    "objects are checked for metadata only; set SBPFLOW_KUBERAY_CRDS to their folder"
)
K8S_VERSION = "1.32.0"
KUBECTL = shutil.which("kubectl")
TARGETS = {"cpu": K8S / "overlays/cpu", "gpu": K8S / "overlays/gpu", "rayjob": K8S / "rayjob"}

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (it renders kustomize)")

Obj = dict[str, Any]


def render(path: Path) -> list[Obj]:
    p = subprocess.run([str(KUBECTL), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"kubectl kustomize {path} failed:\n{p.stderr}"
    return [d for d in yaml.safe_load_all(p.stdout) if d]


@cache
def rendered(name: str) -> tuple[Obj, ...]:
    return tuple(render(TARGETS[name]))


def with_monitoring(tmp: Path) -> list[Obj]:
    """The cpu overlay plus the monitoring component, as deploy/README.md tells users to add it."""
    cpu, monitoring = (os.path.relpath(K8S / p, tmp) for p in ("overlays/cpu", "components/monitoring"))
    (tmp / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{cpu}]\ncomponents: [{monitoring}]\n"
    )
    return render(tmp)


def one(objs: Any, kind: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


# ---- schemas ----------------------------------------------------------------------------------------


def strict(schema: Any) -> Any:
    """An OpenAPI v3 CRD schema that refuses undeclared fields (what the API server's strict field
    validation does; plain JSON Schema would let a misspelt field through)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    return schema


@cache
def crd_schemas() -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) -> a validator of the strict schema of every served version of the KubeRay CRDs."""
    out: dict[tuple[str, str], Any] = {}
    for f in sorted(CRDS.glob("*.yaml")) if CRDS is not None else []:
        crd = yaml.load(f.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            if v.get("served"):
                schema = strict(v["schema"]["openAPIV3Schema"])
                out[(f"{group}/{v['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return out


def validate(obj: Obj) -> None:
    """Raise if ``obj`` is not a valid object of its kind."""
    key = (obj["apiVersion"], obj["kind"])
    if obj["apiVersion"].startswith("ray.io/"):
        if CRDS is not None:  # without the schemas: metadata only (test_crd_schemas_are_there says so)
            assert key in crd_schemas(), f"{key} is no served version of the KubeRay CRDs in {CRDS}"
            body = {k: v for k, v in obj.items() if k != "metadata"}  # metadata: ObjectMeta, checked below
            crd_schemas()[key].validate(body)
        meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}
        kubernetes_validate.validate(meta, K8S_VERSION, strict=True)
    elif obj["apiVersion"].startswith("monitoring.coreos.com/"):
        check_servicemonitor_shape(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def check_servicemonitor_shape(sm: Obj) -> None:
    """The Prometheus Operator's CRD is not vendored here: check the fields this repository uses."""
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    for ep in sm["spec"]["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "authorization"}, ep
        assert re.fullmatch(r"\d+[smh]", ep["interval"]), ep["interval"]


def test_crd_schemas_are_there() -> None:
    if CRDS is None:
        pytest.skip(NO_CRDS)
    assert {k for _, k in crd_schemas()} >= {"RayCluster", "RayJob"}, f"KubeRay CRDs missing from {CRDS}"


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_rendered_object_validates(name: str) -> None:
    objs = rendered(name)
    assert objs
    for obj in objs:
        validate(obj)


def test_the_monitoring_component_renders_and_validates(tmp_path: Path) -> None:
    objs = with_monitoring(tmp_path)
    for obj in objs:
        validate(obj)
    sm, svc = one(objs, "ServiceMonitor"), one(objs, "Service", "sbpflow-control-plane")
    labels = svc["metadata"]["labels"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= labels.items(), (
        "the ServiceMonitor selects no Service"
    )
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert ep["path"] == "/metrics"
    token = env_of(container(one(objs, "Deployment")))["SBPFLOW_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ep["authorization"]["credentials"] == {"name": token["name"], "key": token["key"]}


@pytest.mark.parametrize(
    "mutate, kind",
    [
        (lambda o: o["spec"]["workerGroupSpecs"][0].update(replica=2), "RayCluster"),  # misspelt
        (lambda o: o["spec"]["workerGroupSpecs"][0].pop("groupName"), "RayCluster"),  # required
        (lambda o: o["spec"].update(rayVersion=2.6), "RayCluster"),  # wrong type
        (
            lambda o: o["spec"]["template"]["spec"]["containers"][0].update(imagePullPolcy="Always"),
            "Deployment",
        ),
        (lambda o: o["spec"].update(replicas="one"), "Deployment"),
    ],
)
def test_the_validation_catches_mistakes(mutate: Any, kind: str) -> None:
    if kind.startswith("Ray") and CRDS is None:
        pytest.skip(NO_CRDS)
    obj = copy.deepcopy(one(rendered("cpu"), kind))
    mutate(obj)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(obj)


# ---- wiring -----------------------------------------------------------------------------------------


def container(deployment: Obj) -> Obj:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env", [])}


def server_args(c: Obj) -> Any:
    """The control plane container's ``sbpflow server`` flags, parsed by the real CLI parser, with the
    container's literal env values substituted; plus the ``ray start`` line's flags."""
    script = c["args"][0]
    values = {k: e["value"] for k, e in env_of(c).items() if "value" in e}

    def expand(line: str) -> list[str]:
        words = shlex.split(line)
        return [re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], w) for w in words]

    lines = [line.strip() for line in script.splitlines()]
    (serve,) = [expand(x) for x in lines if x.startswith("exec sbpflow server")]
    (start,) = [expand(x) for x in lines if x.startswith("ray start")]
    return build_parser().parse_args(serve[2:]), start


def ports(c: Obj) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_the_control_plane_joins_the_head_service_with_the_cluster_token(name: str) -> None:
    objs = rendered(name)
    rc, c = one(objs, "RayCluster"), container(one(objs, "Deployment", "sbpflow-control-plane"))
    args, start = server_args(c)
    assert args.command == "server" and args.backend == "ray"
    head = rc["spec"]["headGroupSpec"]
    gcs = ports(head["template"]["spec"]["containers"][0])["gcs-server"]
    assert int(head["rayStartParams"].get("port", 6379)) == gcs
    # KubeRay names the head's Service <cluster>-head-svc
    assert args.ray_address == f"{rc['metadata']['name']}-head-svc:{gcs}"
    assert start[:2] == ["ray", "start"] and f"--address={args.ray_address}" in start
    assert "--num-cpus=0" in start and "--num-gpus=0" in start  # nothing is scheduled beside the server
    env = env_of(c)
    assert env["RAY_AUTH_MODE"]["value"] == rc["spec"]["authOptions"]["mode"] == "token"
    ray_token = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ray_token == {"name": rc["spec"]["authOptions"]["secretName"], "key": "auth_token"}
    assert "valueFrom" in env["SBPFLOW_TOKEN"], "the API token must come from a Secret, not a literal"


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_ports_store_and_service_match_the_server_flags(name: str) -> None:
    objs = rendered(name)
    dep = one(objs, "Deployment", "sbpflow-control-plane")
    c, pod = container(dep), dep["spec"]["template"]
    args, _ = server_args(c)
    assert args.host == "0.0.0.0"  # reachable from the Service and from Ray workers on other pods
    assert ports(c) == {"grpc": args.port, "http": args.http_port, "worker-grpc": args.worker_port}
    assert args.worker_port > 0  # a fixed port the workers dial on the pod's IP (a NetworkPolicy can name it)
    svc = one(objs, "Service", "sbpflow-control-plane")
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    for p in svc["spec"]["ports"]:
        assert ports(c)[p["targetPort"]] == {"grpc": args.port, "http": args.http_port}[p["name"]]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    (store,) = [n for n, v in volumes.items() if "persistentVolumeClaim" in v]
    assert str(Path(args.store).parent) == mounts[store]
    one(objs, "PersistentVolumeClaim", volumes[store]["persistentVolumeClaim"]["claimName"])
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"  # one SQLite writer
    notes = pod["metadata"]["annotations"]
    assert int(notes["prometheus.io/port"]) == args.http_port and notes["prometheus.io/path"] == "/metrics"


def test_probes_hit_open_paths_that_answer_on_a_live_server(tmp_path: Path) -> None:
    from sbpflow.control_plane.service.server import ControlPlane, ServerConfig

    c = container(one(rendered("cpu"), "Deployment", "sbpflow-control-plane"))
    args, _ = server_args(c)
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/healthz" and probes["readinessProbe"]["path"] == "/readyz"
    for probe in probes.values():
        assert ports(c)[probe["port"]] == args.http_port
        assert probe["path"] in OPEN_HTTP_PATHS  # the kubelet sends no token
    config = ServerConfig(
        port=0,
        http_port=0,
        store=str(tmp_path / "j.db"),
        run=MANAGER_DEFAULTS.replace(backend="inprocess"),
        auth_token="t",
    )
    plane = ControlPlane(config).start()
    try:
        for probe in probes.values():  # as the kubelet calls them: no token
            with urllib.request.urlopen(plane.http_address + probe["path"], timeout=10) as r:
                assert r.status == 200, probe
        # the scrape path needs the token (so the ServiceMonitor sends it) and answers with it
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(plane.http_address + "/metrics", timeout=10)
        authorized = urllib.request.Request(
            plane.http_address + "/metrics", headers={"Authorization": "Bearer t"}
        )
        with urllib.request.urlopen(authorized, timeout=10) as r:
            assert r.status == 200 and b"sbpflow_jobs" in r.read()
    finally:
        plane.stop()


def pods(obj: Obj) -> list[Obj]:
    """Every pod template in a Deployment, RayCluster or RayJob."""
    spec = obj["spec"]
    if obj["kind"] == "Deployment":
        return [spec["template"]]
    cluster = spec["rayClusterSpec"] if obj["kind"] == "RayJob" else spec
    return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_container_is_sized_non_root_and_on_the_overlay_image(name: str) -> None:
    tag = {"cpu": "-cpu", "gpu": "-gpu", "rayjob": "-cpu"}[name]
    for obj in rendered(name):
        if obj["kind"] not in ("Deployment", "RayCluster", "RayJob"):
            continue
        for pod in pods(obj):
            sc = pod["spec"]["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == IMAGE_UID, obj["metadata"]["name"]
            for c in pod["spec"]["containers"]:
                res = c["resources"]
                assert {"cpu", "memory"} <= res["requests"].keys() and {"cpu", "memory"} <= res[
                    "limits"
                ].keys()
                assert c["image"].endswith(tag), c["image"]


def gpu_limits(obj: Obj) -> list[str]:
    return [
        c["resources"]["limits"]["nvidia.com/gpu"]
        for pod in pods(obj)
        for c in pod["spec"]["containers"]
        if "nvidia.com/gpu" in c["resources"].get("limits", {})
    ]


def test_gpu_workers_only_in_the_gpu_overlay() -> None:
    gpu = one(rendered("gpu"), "RayCluster")
    groups = {g["groupName"]: g for g in gpu["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu"}
    assert gpu_limits(gpu) == ["1"] and groups["gpu"]["replicas"] >= 1
    cpu = one(rendered("cpu"), "RayCluster")
    assert [g["groupName"] for g in cpu["spec"]["workerGroupSpecs"]] == ["cpu"] and gpu_limits(cpu) == []
    assert one(rendered("rayjob"), "RayJob") and gpu_limits(one(rendered("rayjob"), "RayJob")) == []


def test_the_rayjob_entrypoint_is_a_real_command_on_a_shipped_example() -> None:
    job = one(rendered("rayjob"), "RayJob")
    words = shlex.split(job["spec"]["entrypoint"])
    assert words[0] == "sbpflow"
    args = build_parser().parse_args(words[1:])
    assert args.command == "run" and args.backend == "ray"
    # the images copy examples/ to /home/ray/examples
    assert args.example.startswith("/home/ray/examples/")
    assert (ROOT / "examples" / Path(args.example).name).is_file()
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0" and job["spec"]["entrypointNumCpus"] == 0


# ---- images -----------------------------------------------------------------------------------------

IMAGE_UID = 1000


def dockerfile(name: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """(ARG defaults, [(instruction, rest)]) of deploy/<name>, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / name).read_text())
    steps = [
        tuple(line.strip().split(None, 1))
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    args = {k: v for ins, rest in steps if ins == "ARG" and "=" in rest for k, v in [rest.split("=", 1)]}
    return args, [(ins.upper(), rest) for ins, rest in steps]  # type: ignore[misc]


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_images_run_the_server_as_a_non_root_user(name: str) -> None:
    import json

    args, steps = dockerfile(name)
    users = [rest for ins, rest in steps if ins == "USER"]
    assert users and users[-1] == str(IMAGE_UID)
    entry = json.loads(next(rest for ins, rest in steps if ins == "ENTRYPOINT"))
    cmd = json.loads(next(rest for ins, rest in steps if ins == "CMD"))
    assert entry[-1] == "sbpflow"
    served = build_parser().parse_args(cmd)
    assert served.command == "server" and served.host == "0.0.0.0"
    c = container(one(rendered("cpu"), "Deployment", "sbpflow-control-plane"))
    assert {served.port, served.http_port, served.worker_port} == set(ports(c).values())
    exposed = {int(p) for ins, rest in steps if ins == "EXPOSE" for p in rest.split()}
    assert exposed == {served.port, served.http_port, served.worker_port}
    assert str(Path(served.store).parent) in " ".join(rest for ins, rest in steps if ins == "RUN")


def test_both_images_carry_one_python_and_the_manifests_ray() -> None:
    (cpu, cpu_steps), (gpu, gpu_steps) = dockerfile("Dockerfile.cpu"), dockerfile("Dockerfile.gpu")
    assert cpu["PYTHON_VERSION"] == gpu["PYTHON_VERSION"] and cpu["RAY_VERSION"] == gpu["RAY_VERSION"]
    versions = {one(rendered("cpu"), "RayCluster")["spec"]["rayVersion"]}
    versions.add(one(rendered("rayjob"), "RayJob")["spec"]["rayClusterSpec"]["rayVersion"])
    assert versions == {cpu["RAY_VERSION"]}
    # one base under both (the registry's python image or its stand-in, a build argument of each); CUDA
    # 12's user-space libraries come as wheels, the driver from the host's NVIDIA container toolkit
    assert cpu["BASE"] == gpu["BASE"] == "python:${PYTHON_VERSION}-slim-bookworm"
    assert [rest for ins, rest in cpu_steps if ins == "FROM"] == [
        rest for ins, rest in gpu_steps if ins == "FROM"
    ]
    assert "cupy-cuda12x[ctk]" in " ".join(rest for ins, rest in gpu_steps if ins == "RUN")

    # the GPU image's deps stage starts with the CPU one's very steps (Ray included), so a host building
    # both (the tests do) builds those layers once
    def deps(steps: list[tuple[str, str]]) -> list[tuple[str, str]]:
        start = steps.index(("FROM", "${BASE} AS deps"))
        return steps[start : next(i for i in range(start + 1, len(steps)) if steps[i][0] == "FROM")]

    assert deps(gpu_steps)[: len(deps(cpu_steps))] == deps(cpu_steps)
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in " ".join(
        rest for ins, rest in gpu_steps if ins == "ENV"
    )
    assert "[gpu]" in " ".join(rest for ins, rest in gpu_steps if ins == "RUN")
    assert "[gpu]" not in " ".join(rest for ins, rest in cpu_steps if ins == "RUN")


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_everything_an_image_copies_exists_and_is_not_ignored(name: str) -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    _, steps = dockerfile(name)
    sources = [
        src
        for ins, rest in steps
        if ins == "COPY" and "--from=" not in rest
        for src in [w for w in rest.split() if not w.startswith("--")][:-1]
    ]
    assert {"pyproject.toml", "sbpflow", "client", "control_plane", "actor_workers", "examples"} <= set(
        sources
    )
    for src in sources:
        assert (ROOT / src).exists(), f"{name} copies {src}, which is not in the repository"
        assert src not in ignored, f"{name} copies {src}, which .dockerignore leaves out of the build context"
