"""infra/'s per-service NATS users: the checked-in users block is what `jetrl bus permissions`
generates (and its copies for Kubernetes), nats-server accepts it, and compose and Kubernetes give
every service its own user, its own password file only, and `bus_declare=false`, with `jetrl bus
init` run once as the admin."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from services.bus.nats_server import find_binary
from services.bus.permissions import ADMIN, authorization_block, passwords_conf, service_permissions, users

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
PASSWORDS = "secrets/nats-passwords"  # nats-server resolves includes against the including file's directory
# compose service -> the NATS user it runs as (inference is not on the bus)
COMPOSE_USERS = {"bus-init": ADMIN, "trainer": "trainer", "rollout": "rollout", "reward": "reward", "weights": "weights"}


def test_checked_in_users_block_is_the_generated_one() -> None:
    expected = authorization_block(passwords_include=PASSWORDS)
    for path in (INFRA / "nats-users.conf", INFRA / "k8s/base/nats-users.conf", INFRA / "k8s/overlays/cluster/nats-users.conf"):
        assert path.read_text() == expected, f"{path} drifted: regenerate it with `jetrl bus permissions --passwords-include {PASSWORDS}`"
    assert (INFRA / "k8s/base/nats-auth.conf").read_text() == (INFRA / "nats-auth.conf").read_text()


def test_nats_server_accepts_the_auth_config(tmp_path: Path) -> None:
    """nats-auth.conf with the users block, as nats-server reads it (`-t`), with the passwords file
    where the containers mount it (beside the users file)."""
    (tmp_path / "secrets").mkdir()
    (tmp_path / PASSWORDS).write_text(passwords_conf({u: f"pw-{u}" for u in users()}))
    (tmp_path / "nats-server.conf").write_text((INFRA / "nats-server.conf").read_text().replace("/data/jetstream", str(tmp_path / "js")))
    (tmp_path / "nats-users.conf").write_text((INFRA / "nats-users.conf").read_text())
    (tmp_path / "nats-auth.conf").write_text((INFRA / "nats-auth.conf").read_text())
    proc = subprocess.run([find_binary(), "-c", str(tmp_path / "nats-auth.conf"), "-t"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_service_user_is_restricted_and_the_admin_is_not() -> None:
    text = authorization_block()
    assert f"{{user: {ADMIN}, password: $JETRL_NATS_PASSWORD_ADMIN}}" in text  # no permissions: everything
    for perms in service_permissions():
        assert f"{{user: {perms.user}, password: $JETRL_NATS_PASSWORD_{perms.user.upper()}, permissions:" in text
        assert ">" not in perms.publish and "$JS.API.>" not in perms.publish, perms.user
        assert not any(p.startswith(("$JS.API.STREAM.CREATE", "$JS.API.STREAM.UPDATE", "$JS.API.STREAM.DELETE")) for p in perms.publish)


def test_compose_runs_bus_init_as_admin_and_every_service_as_its_own_user() -> None:
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    services = compose["services"]
    assert services["nats"]["command"] == ["--config", "/etc/nats/nats-auth.conf"]
    assert services["nats"]["secrets"] == [{"source": "nats-passwords", "target": "/etc/nats/secrets/nats-passwords"}]
    assert services["bus-init"]["command"] == ["bus", "init"] and services["bus-init"]["restart"] == "on-failure"
    for name, user in COMPOSE_USERS.items():
        spec = services[name]
        env = {k.split("__", 1)[1]: v for k, v in spec["environment"].items() if k.startswith("JETRL_")}
        assert env["NATS_AUTH__USER"] == user, name
        assert env["NATS_AUTH__PASSWORD_FILE"] == f"/run/secrets/nats-{user}", name
        trust = {"trainer": ["announce-key", "inference-admin-key"], "weights": ["inference-admin-key", "announce-key"]}
        assert spec["secrets"] == [f"nats-{user}", *trust.get(name, [])], f"{name} must see only its own password"
        assert not any(k.endswith(("__PASSWORD", "__TOKEN")) for k in env), f"{name}: a secret in the environment"
        if name != "bus-init":
            assert env["BUS_DECLARE"] == "false", name
            assert spec["depends_on"]["bus-init"] == {"condition": "service_completed_successfully"}, name
    cluster = yaml.safe_load((INFRA / "compose.cluster.yaml").read_text())["services"]
    assert cluster["bus-init"]["environment"]["JETRL_BUS__NATS_REPLICAS"] == "3"
    for node in ("nats-2", "nats-3"):
        assert cluster[node]["command"] == ["--config", "/etc/nats/nats-auth.conf"]
        assert cluster[node]["secrets"][0]["target"] == "/etc/nats/secrets/nats-passwords"


def test_k8s_mounts_only_each_pods_own_password() -> None:
    from tests.unit.test_infra_static import kustomize

    for overlay in ("base", "overlays/cluster"):
        docs = kustomize(INFRA / "k8s" / overlay)
        keys = {}
        for doc in docs:
            if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
                continue
            for vol in doc["spec"]["template"]["spec"].get("volumes", []):
                if vol.get("secret", {}).get("secretName") == "jetrl-nats":
                    keys.setdefault(doc["metadata"]["name"], []).extend(i["key"] for i in vol["secret"]["items"])
        trust = ["announce-key", "inference-admin-key"]  # the trust keys: the signer/checkers and the admin-route callers
        expected = {"bus-init": [ADMIN], "trainer": ["trainer", *trust], "rollout": ["rollout"], "reward": ["reward"],
                    "inference": ["weights", "inference-admin-key", "announce-key"]}
        if overlay == "base":
            expected["nats"] = ["nats-passwords.conf"]
        assert keys == expected, overlay


def test_the_reward_discovery_subjects_use_its_real_service_name() -> None:
    from services.bus.permissions import REWARD_SERVICE
    from services.reward.service import SERVICE_NAME

    assert REWARD_SERVICE == SERVICE_NAME
