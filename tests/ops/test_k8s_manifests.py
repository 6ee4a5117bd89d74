"""The Kubernetes manifests under ops/k8s/: core resources validated (strict:
no unknown fields) against the Kubernetes schemas that ``kubernetes-validate``
bundles (no network), and the numbers and names that must agree across
files checked against each other and against the server's own flags and
metrics. The Gateway API and Inference Extension resources (CRDs, whose
schemas are not bundled) get the cross-checks only."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from slipstream.service.cli import build_parser
from slipstream.service.engine.events import PoolStats
from slipstream.service.telemetry.metrics import _picker_gauges

K8S = Path(__file__).resolve().parents[2] / "ops" / "k8s"
# The oldest release whose schema has the preStop `sleep` action, and the newest bundled.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CORE_GROUPS = {"v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1"}


def documents(pattern: str) -> list[dict]:
    docs = []
    for path in sorted(K8S.glob(pattern)):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


ALL = documents("*.yaml") + documents("gateway/*.yaml")


@pytest.mark.parametrize("version", VERSIONS)
def test_core_resources_validate_against_the_kubernetes_schemas(version: str) -> None:
    core = [d for d in ALL if d["apiVersion"] in CORE_GROUPS]
    assert {d["kind"] for d in core} >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
    }
    for doc in core:
        kubernetes_validate.validate(doc, version, strict=True)


def test_validation_catches_a_mistake() -> None:
    deployment = by_kind(ALL, "Deployment", "slipstream")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def serve_flags(deployment: dict) -> dict[str, str]:
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return dict(arg.removeprefix("--").split("=", 1) for arg in args)


def test_the_server_accepts_the_deployments_flags() -> None:
    flags = serve_flags(by_kind(ALL, "Deployment", "slipstream"))
    argv = ["serve", *(f"--{k}={v}" for k, v in flags.items())]
    args = build_parser().parse_args(argv)
    assert args.grace_s == 300 and args.max_connection_age_grace_s == 330


def test_termination_grace_covers_the_prestop_pause_and_the_drain() -> None:
    deployment = by_kind(ALL, "Deployment", "slipstream")
    pod = deployment["spec"]["template"]["spec"]
    flags = serve_flags(deployment)
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + float(flags["grace-s"])
    # Connections outlive the longest request: GOAWAY's grace covers it too.
    assert float(flags["max-connection-age-grace-s"]) >= float(flags["grace-s"])
    probes = pod["containers"][0]
    assert probes["readinessProbe"]["grpc"]["service"] == "slipstream.v1.Inference"
    assert "grpc" in probes["livenessProbe"]


def test_services_pdb_and_pool_select_the_deployments_pods() -> None:
    labels = by_kind(ALL, "Deployment", "slipstream")["spec"]["template"]["metadata"]["labels"]
    headless = by_kind(ALL, "Service", "slipstream-headless")
    assert headless["spec"]["clusterIP"] == "None"
    for selector in (
        headless["spec"]["selector"],
        by_kind(ALL, "Service", "slipstream")["spec"]["selector"],
        by_kind(ALL, "PodDisruptionBudget", "slipstream")["spec"]["selector"]["matchLabels"],
        by_kind(ALL, "InferencePool", "slipstream")["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()
    pool = by_kind(ALL, "InferencePool", "slipstream")
    assert pool["spec"]["appProtocol"] == "kubernetes.io/h2c"
    assert pool["spec"]["targetPorts"] == [{"number": 50051}]
    epp = by_kind(ALL, "Service", pool["spec"]["endpointPickerRef"]["name"])
    assert epp["spec"]["ports"][0]["port"] == pool["spec"]["endpointPickerRef"]["port"]["number"]


def test_the_endpoint_picker_reads_metrics_the_server_publishes() -> None:
    epp = by_kind(ALL, "Deployment", "slipstream-epp")
    args = dict(
        a.removeprefix("--").split("=", 1)
        for a in epp["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    published = {m.name for m in _picker_gauges(0, 0, PoolStats(0, 1))}
    for flag in (
        "total-queued-requests-metric",
        "total-running-requests-metric",
        "kv-cache-usage-percentage-metric",
    ):
        assert args[flag] in published
    annotations = by_kind(ALL, "Deployment", "slipstream")["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert args["model-server-metrics-port"] == annotations["prometheus.io/port"]


def test_the_route_sends_generate_one_to_the_pool_with_a_long_timeout() -> None:
    route = by_kind(ALL, "GRPCRoute", "slipstream")
    (rule,) = route["spec"]["rules"]
    methods = {m["method"]["method"] for m in rule["matches"]}
    assert "GenerateOne" in methods and "Generate" not in methods
    assert rule["backendRefs"][0]["kind"] == "InferencePool"
    policy = by_kind(ALL, "BackendTrafficPolicy", "slipstream-timeouts")
    timeout = policy["spec"]["timeout"]["http"]["requestTimeout"]
    grace = float(serve_flags(by_kind(ALL, "Deployment", "slipstream"))["grace-s"])
    assert float(re.fullmatch(r"(\d+)s", timeout).group(1)) > grace  # type: ignore[union-attr]
