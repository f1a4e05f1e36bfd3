"""The Kubernetes manifests under examples/kubernetes describe jobs whose pods agree on their roles.

No Kubernetes runs here: each manifest's pod templates are expanded for every replica index the way the
kubelet would (``fieldRef`` to the index, ``secretKeyRef`` to one secret, ``$(VAR)`` from earlier
variables), and the resulting environments go through ``runtime.role.role_from_env``. The job is
consistent when every pod parses, the trainer ids cover ``0..n-1`` once each, the pservers' own endpoints
are exactly the listed ones, and every pod names the same pservers and trainers.
"""
from __future__ import annotations

import pathlib
import re

import pytest

from runtime.role import role_from_env

yaml = pytest.importorskip("yaml", reason="PyYAML reads the manifests (it comes with the ray extra)")

MANIFESTS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "kubernetes"
TOKEN = "0" * 64


def _pod_templates(doc: dict) -> list[tuple[dict, int]]:
    """(pod spec, replica count) of each replica group a document starts."""
    if doc["kind"] == "Job":
        return [(doc["spec"]["template"]["spec"], int(doc["spec"]["completions"]))]
    if doc["kind"] == "PaddleJob":
        return [(r["template"]["spec"], int(r["replicas"])) for r in doc["spec"]["paddleReplicaSpecs"].values()]
    return []


def _environ(container: dict, index: int) -> dict[str, str]:
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(var["value"]))
        elif "fieldRef" in var["valueFrom"]:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert "job-completion-index" in path or "replica-index" in path, path
            env[var["name"]] = str(index)
        else:
            assert "secretKeyRef" in var["valueFrom"]
            env[var["name"]] = TOKEN
    return env


@pytest.mark.parametrize("name", sorted(p.name for p in MANIFESTS.glob("*.yaml")))
def test_manifest_pods_form_one_job(name: str) -> None:
    roles = []
    for doc in yaml.safe_load_all((MANIFESTS / name).read_text()):
        for spec, replicas in _pod_templates(doc):
            (container,) = spec["containers"]
            for index in range(replicas):
                env = _environ(container, index)
                assert env["FLOTILLA_JOB_TOKEN"] == TOKEN  # a job spanning hosts needs the shared secret
                roles.append(role_from_env(env))
    assert roles, f"{name} starts no pod"
    pservers = {r.pserver_endpoints for r in roles}
    assert len(pservers) == 1, f"{name}: pods disagree on the pservers: {pservers}"
    trainers = [r for r in roles if r.is_trainer]
    assert sorted(r.trainer_id for r in trainers) == list(range(trainers[0].trainers))
    assert {r.trainer_endpoints for r in trainers} == {trainers[0].trainer_endpoints}
    assert sorted(r.current_endpoint for r in roles if r.is_pserver) == sorted(next(iter(pservers)))
    if not next(iter(pservers)):  # collective: each trainer is its own entry of the endpoint list
        assert all(r.is_collective and r.current_endpoint == r.trainer_endpoints[r.trainer_id] for r in trainers)
