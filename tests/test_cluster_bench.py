"""The cluster benchmark end to end, at toy size: a simulated cluster, kvroute, two rates, a report."""

import json
import subprocess
import sys

import yaml


def test_a_small_cluster_benchmark_writes_its_tables_and_skips_what_is_not_installed(tmp_path):
    config = {"name": "smoke", "cluster": {"profile": "aurora-pvc-tp2", "replicas": 2, "num_gpu_blocks": 64,
                                            "time_scale": 0.2},
              "workload": {"kind": "shared-prefix", "groups": 3, "prompts_per_group": 4, "system_tokens": 256,
                           "question_tokens": 16, "output_tokens": 4},
              "requests_per_rate": 12, "rates": [0.5, 1.0], "saturation_concurrency": 8,
              "routers": ["kvroute", "no-such-router"]}
    routers = {"kvroute": "{python} -m router serve --port {port} {replica_args}",
               "no-such-router": "no-such-router-binary --port {port} {urls}"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(routers))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "loadtest.cluster_bench", "--config", str(tmp_path / "c.yaml"),
                        "--routers", str(tmp_path / "r.yaml"), "--out", str(out)], capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    rows = res["results"][0]["rows"]
    assert res["saturation_rps"] > 0 and len(rows) == 2
    assert all(r["errors"] == 0 and r["requests"] == 12 and sum(r["share"].values()) == 12 for r in rows)
    assert "no-such-router" in res["skipped"] and "not installed" in res["skipped"]["no-such-router"]
    assert "| kvroute |" in (out / "results.md").read_text()
