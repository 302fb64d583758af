"""Configuration: one typed object from YAML, environment and flags, with errors that name the field."""

import subprocess
import sys

import pytest

from router.config import ConfigError, load_config


def write(tmp_path, text):
    p = tmp_path / "kvroute.yaml"
    p.write_text(text)
    return p


def test_defaults_need_no_file():
    cfg = load_config(None, environ={})
    assert cfg.port == 8000 and cfg.policy == "cache-aware" and cfg.replicas == []
    assert cfg.index.backend == "memory"


def test_yaml_replica_fields(tmp_path):
    cfg = load_config(write(tmp_path, """
replicas:
  - name: gaudi-node-1
    url: http://10.0.0.1:8000/
    platform: gaudi2
    tensor_parallel_size: 8
    max_num_seqs: 128
    api_key: secret
"""), environ={})
    r = cfg.replicas[0]
    assert (r.name, r.url, r.platform, r.tensor_parallel_size, r.max_num_seqs) == (
        "gaudi-node-1", "http://10.0.0.1:8000", "gaudi2", 8, 128)
    assert r.api_key.get_secret_value() == "secret"


def test_replica_name_defaults_to_host_and_port():
    cfg = load_config(None, environ={}, overrides={"replicas": [{"url": "http://h:9000"}]})
    assert cfg.replicas[0].name == "h:9000"


def test_environment_overrides_file_and_flags_override_environment(tmp_path):
    path = write(tmp_path, "port: 1111\nproxy:\n  max_attempts: 2\n")
    env = {"KVROUTE_PORT": "2222", "KVROUTE_PROXY__MAX_ATTEMPTS": "4", "KVROUTE_REPLICAS": "a=http://x:1,http://y:2"}
    cfg = load_config(path, environ=env)
    assert cfg.port == 2222 and cfg.proxy.max_attempts == 4
    assert [(r.name, r.url) for r in cfg.replicas] == [("a", "http://x:1"), ("y:2", "http://y:2")]
    cfg = load_config(path, environ=env, overrides={"port": 3333})
    assert cfg.port == 3333


def test_keys_from_environment():
    cfg = load_config(None, environ={"KVROUTE_API_KEYS": "k1,k2", "KVROUTE_ADMIN_KEY": "adm"})
    assert [k.get_secret_value() for k in cfg.auth.api_keys] == ["k1", "k2"]
    assert cfg.auth.admin_key.get_secret_value() == "adm"


@pytest.mark.parametrize("text, field", [
    ("replicas:\n  - url: http://h:1\n    tensor_parallel_size: 0\n", "replicas.0.tensor_parallel_size"),
    ("replicas:\n  - url: ftp://h:1\n", "replicas.0.url"),
    ("replicas:\n  - url: http://h:1\n    platform: tpu\n", "replicas.0.platform"),
    ("policy: fastest\n", "policy"),
    ("proxy:\n  stream_idle_timeout_s: -1\n", "proxy.stream_idle_timeout_s"),
    ("queue:\n  max_sizes: 3\n", "queue.max_sizes"),
    ("replicas:\n  - {name: a, url: 'http://h:1'}\n  - {name: a, url: 'http://h:2'}\n", "replica name 'a' is used twice"),
])
def test_invalid_values_name_the_field(tmp_path, text, field):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), environ={})
    assert field in str(e.value)


def test_secret_values_are_not_echoed_in_errors(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "auth:\n  admin_key: [not, a, string]\n"), environ={})
    assert "auth.admin_key" in str(e.value)


def test_a_password_in_a_redis_url_is_not_echoed_in_errors(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "index:\n  backend: redis://app:hunter2@redis:99999/0\n"), environ={})
    assert "index.backend" in str(e.value) and "redis://app:***@redis:99999/0" in str(e.value)
    assert "hunter2" not in str(e.value)


def test_unreadable_and_invalid_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", environ={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "replicas: [\n"), environ={})


def test_cli_stops_on_bad_config_with_the_field_name(tmp_path):
    p = subprocess.run([sys.executable, "-m", "router", "serve", "--replica", "http://h:1", "--set",
                        "proxy.max_attempts=0"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert "proxy.max_attempts" in p.stderr


def test_cli_check_config_masks_keys():
    p = subprocess.run([sys.executable, "-m", "router", "check-config", "--replica", "http://h:1"],
                       capture_output=True, text=True, timeout=30, env={"KVROUTE_API_KEYS": "topsecret", "PATH": ""})
    assert p.returncode == 0, p.stderr
    assert "topsecret" not in p.stdout and "'**********'" in p.stdout


def test_index_default_blocks_sizes_replicas_whose_cache_is_not_known_yet():
    from router.gateway import Gateway
    from router.config import RouterConfig
    cfg = RouterConfig(replicas=[{"url": "http://127.0.0.1:9"}, {"url": "http://127.0.0.1:10", "num_gpu_blocks": 77}],
                       index={"default_blocks": 1234})
    assert [r.kv_blocks for r in Gateway(cfg).pool] == [1234, 77]


def test_check_config_validates_the_policy_pipeline(tmp_path):
    import subprocess
    import sys

    from loadtest.cluster import ROOT
    path = tmp_path / "kvroute.yaml"
    path.write_text("replicas: [{url: 'http://127.0.0.1:9'}]\npolicy: {scorers: [{name: load}, {name: fastest}]}\n")
    out = subprocess.run([sys.executable, "-m", "router", "check-config", "--config", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "policy.scorers.1.name: unknown scorer 'fastest'" in out.stderr
