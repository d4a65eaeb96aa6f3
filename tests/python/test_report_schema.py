"""The --json report as a contract (docs/report.schema.json, docs/runtime.md "Report").

Real reports of `refit run` / `refit bench` / `refit trainer`, successful, failed and stopped by a
setup error, validate against the schema; a failed run's report names the error and the process
blamed (the command, for a setup error) and never leaves an earlier run's report behind; a --json
path that cannot be written exits 2 before any rank starts.
"""

import json
import os
import subprocess

import jsonschema
import pytest

from refit_testing import free_port, refit_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = refit_cli()

pytestmark = pytest.mark.skipif(CLI is None, reason="no refit CLI built (set REFIT_CLI)")

# Small and quick: 2 trainer ranks -> one engine of TP 2, transfer plan.
CONFIG = """model: tiny-qwen3
device: cpu
seed: 3
policy: {{backend: fsdp2, world_size: 2, dtype: float32}}
generation: {{backend: sglang, colocated: false, num_engines: 1, tp_size: 2}}
refit: {{target_precision: bf16, buffer_size_bytes: 65536, timeout_s: 5, executor: {executor}}}
"""

# What an earlier, successful run left at the path.
STALE = {"schema_version": 3, "ok": True, "stale": True}


@pytest.fixture(scope="module")
def validator():
    with open(os.path.join(ROOT, "docs", "report.schema.json")) as f:
        schema = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def write_config(tmp_path, executor="auto", text=None):
    path = tmp_path / "config.yaml"
    path.write_text(text if text is not None else CONFIG.format(executor=executor))
    return str(path)


def cli(*args, env=None, timeout=60):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def load_valid(validator, path, out):
    assert os.path.isfile(path), f"no report at {path}\n{out.stdout}{out.stderr}"
    with open(path) as f:
        report = json.load(f)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(report)]
    assert not errors, "\n".join(errors) + "\n" + json.dumps(report, indent=2)
    assert report["schema_version"] == 7
    return report


def no_leftovers(directory):
    """Nothing but the report itself: the temporary file was renamed."""
    return [n for n in os.listdir(directory) if n != "report.json" and n != "config.yaml"]


@pytest.mark.parametrize("executor", ["auto", "gather"])
def test_successful_run_report_validates(tmp_path, validator, executor):
    json_path = tmp_path / "report.json"
    json_path.write_text(json.dumps(STALE))
    out = cli("run", write_config(tmp_path, executor), "--steps", "2", "--verify",
              "--json", str(json_path))
    assert out.returncode == 0, out.stdout + out.stderr
    report = load_valid(validator, json_path, out)
    assert report["ok"] is True and "error" not in report and "stale" not in report
    assert report["steps"] == 2 and report["verified"] is True
    assert len(report["refit_seconds"]) == 2
    assert [(r["role"], r["rank"]) for r in report["ranks"]] == [
        ("trainer", 0), ("trainer", 1), ("engine", 0), ("engine", 1)]
    assert report["executor"] == executor and report["config"]["model"] == "tiny-qwen3"
    # Every rank's control-plane work: at least each engine's begin and committed per refit, each
    # of them inside a refit, and setup's store requests besides.
    control = report["control"]
    assert control["refit_mailbox_messages"] >= 2 * 2 * 2, control
    assert control["mailbox_messages"] > control["refit_mailbox_messages"], control
    assert control["store_requests"] > control["refit_store_requests"] > 0, control
    assert all(r["setup_seconds"] > 0 for r in report["ranks"])
    # Each rank holds its own view of the transfer plan (none with gather).
    assert all((r["plan_bytes"] > 0) == (executor != "gather") for r in report["ranks"])
    assert no_leftovers(tmp_path) == []


def test_bench_report_validates(tmp_path, validator):
    json_path = tmp_path / "report.json"
    out = cli("bench", write_config(tmp_path), "--json", str(json_path), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    report = load_valid(validator, json_path, out)
    assert report["ok"] is True and report["steps"] == 3
    for key in ("raw_seconds", "limit_gbps", "ratio", "limit", "floor_seconds", "ratio_to_floor"):
        assert key in report, key


def failed_run(tmp_path, validator, fault, *extra):
    """`refit run` with a fault, over a stale success report: exit 1 and a valid failure report."""
    json_path = tmp_path / "report.json"
    json_path.write_text(json.dumps(STALE))
    out = cli("run", write_config(tmp_path), "--steps", "2", "--fault", fault, *extra,
              "--json", str(json_path))
    assert out.returncode == 1, out.stdout + out.stderr
    report = load_valid(validator, json_path, out)
    assert report["ok"] is False and "stale" not in report, report
    error = report["error"]
    assert error["message"].startswith(error["process"] + ": "), error
    if error["role"] == "trainer":
        assert error["process"] == f"trainer rank {error['rank']}", error
    else:
        assert error["process"] == f"engine 0 tp rank {error['rank']}", error
    # The CLI's own account names the same process.
    assert error["process"] in out.stderr + out.stdout, out.stderr
    assert no_leftovers(tmp_path) == []
    return report, out


def test_corruption_report_names_the_engine_that_caught_it(tmp_path, validator):
    report, _ = failed_run(tmp_path, validator, "corrupt:0", "--verify")
    error = report["error"]
    assert error["role"] == "engine" and error["rank"] in (0, 1), error
    assert "verify:" in error["message"] and "tensor model." in error["message"], error


def test_killed_engine_is_blamed(tmp_path, validator):
    report, _ = failed_run(tmp_path, validator, "kill-engine:1:0")
    error = report["error"]
    assert (error["role"], error["rank"], error["process"]) == ("engine", 1, "engine 0 tp rank 1")
    assert "killed by signal 9" in error["message"], error


def test_killed_trainer_rank_0_is_blamed_by_the_launcher(tmp_path, validator):
    # Trainer rank 0, which writes reports, is the one killed: `refit run` writes it instead.
    report, _ = failed_run(tmp_path, validator, "kill-trainer:0:0")
    error = report["error"]
    assert (error["role"], error["rank"], error["process"]) == ("trainer", 0, "trainer rank 0")
    assert "killed by signal 9" in error["message"], error


UNWRITABLE = {
    "missing directory": lambda tmp: str(tmp / "no" / "such" / "dir" / "report.json"),
    "a directory": lambda tmp: str(tmp),
    "under a file": lambda tmp: str(tmp / "config.yaml" / "report.json"),
}


@pytest.mark.parametrize("command", ["run", "bench", "trainer"])
@pytest.mark.parametrize("kind", sorted(UNWRITABLE))
def test_unwritable_json_path_is_a_setup_error(tmp_path, command, kind):
    config = write_config(tmp_path)
    path = UNWRITABLE[kind](tmp_path)
    before = sorted(os.listdir(tmp_path))
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "REFIT_LOG": "debug"}
    out = cli(command, config, "--json", path, env=env, timeout=30)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"--json {path}" in out.stderr, out.stderr
    # Nothing started: no rank logged a line (REFIT_LOG=debug makes them talk), no refit ran,
    # nothing was created.
    assert out.stdout == "", out.stdout
    assert "[refit trainer" not in out.stderr and "[refit engine" not in out.stderr, out.stderr
    assert sorted(os.listdir(tmp_path)) == before


def setup_error_report(validator, tmp_path, *args, env=None):
    """A command stopped by a setup error, over a stale success report: exit 2, and in place of
    the stale report this run's, `ok: false`, blaming the command."""
    json_path = tmp_path / "report.json"
    json_path.write_text(json.dumps(STALE))
    out = cli(*args, "--json", str(json_path), env=env, timeout=30)
    assert out.returncode == 2, out.stdout + out.stderr
    report = load_valid(validator, json_path, out)
    assert report["ok"] is False and "stale" not in report, report
    error = report["error"]
    assert error["role"] == "setup" and "rank" not in error, error
    assert error["process"] == "refit " + args[0], error
    # The report carries the error the CLI printed, after the command's name.
    assert error["message"].startswith(error["process"] + ": "), error
    printed = error["message"][len(error["process"]) + 2:]
    assert f"refit: error: {printed}" in out.stderr, (printed, out.stderr)
    # Nothing started.
    assert "[refit trainer" not in out.stderr and "[refit engine" not in out.stderr, out.stderr
    assert no_leftovers(tmp_path) == []
    return report


def test_setup_error_in_the_config_is_reported(tmp_path, validator):
    bad = CONFIG.format(executor="auto").replace("world_size: 2", "world_size: 0")
    report = setup_error_report(validator, tmp_path, "run", write_config(tmp_path, text=bad))
    assert "policy.world_size" in report["error"]["message"], report
    # The config could not be read: the report has none, nor an executor.
    assert "config" not in report and "executor" not in report, report
    assert report["steps"] == 1 and report["verified"] is False


def test_missing_config_file_is_reported(tmp_path, validator):
    missing = str(tmp_path / "nonexistent.yaml")
    report = setup_error_report(validator, tmp_path, "run", missing, "--verify")
    assert "not found" in report["error"]["message"] and missing in report["error"]["message"]
    assert "config" not in report and report["verified"] is True, report


def test_fault_past_the_plan_is_reported_with_the_config(tmp_path, validator):
    report = setup_error_report(validator, tmp_path, "run", write_config(tmp_path), "--steps", "2",
                                "--fault", "corrupt:999")
    assert "--fault corrupt:999" in report["error"]["message"], report
    assert "past the plan" in report["error"]["message"], report
    assert report["config"]["model"] == "tiny-qwen3" and report["executor"] == "auto", report
    assert report["steps"] == 2, report


def test_bench_and_trainer_setup_errors_name_their_command(tmp_path, validator):
    bad = CONFIG.format(executor="auto").replace("tp_size: 2", "tp_size: 3")
    report = setup_error_report(validator, tmp_path, "bench", write_config(tmp_path, text=bad))
    assert "generation.tp_size" in report["error"]["message"], report
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    report = setup_error_report(validator, tmp_path, "trainer", write_config(tmp_path),
                                "--fault", "corrupt:999", env=env)
    assert "past the plan" in report["error"]["message"] and "config" in report, report
