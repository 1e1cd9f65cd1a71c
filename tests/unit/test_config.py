import pytest

from services.common.config import load_config
from services.engine.config import EngineConfig
from services.router.config import RouterConfig


def test_flag_beats_env_beats_default(monkeypatch):
    monkeypatch.setenv("LLMSERVE_ENGINE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("LLMSERVE_ENGINE_PORT", "6000")
    cfg = load_config(EngineConfig, "LLMSERVE_ENGINE", ["--port", "6001"])
    assert cfg.port == 6001 and cfg.max_num_seqs == 7 and cfg.max_queue == EngineConfig().max_queue


def test_bad_values_exit_with_a_message_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        load_config(EngineConfig, "LLMSERVE_ENGINE", ["--dtype", "float8"])
    assert "--dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_config(RouterConfig, "LLMSERVE_ROUTER", ["--engines", "nocolon"])
    assert "host:port" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_config(EngineConfig, "LLMSERVE_ENGINE", ["--max-num-seqs", "many"])
    assert "--max-num-seqs" in capsys.readouterr().err


def test_router_engine_list_is_parsed():
    cfg = load_config(RouterConfig, "LLMSERVE_ROUTER", ["--engines", "a:1, b:2,"])
    assert cfg.engine_addresses == ["a:1", "b:2"]


def test_model_manager_flags(capsys):
    cfg = load_config(EngineConfig, "LLMSERVE_ENGINE", ["--memory-budget-mb", "2048", "--warm-models", "a,b"])
    assert cfg.memory_budget_mb == 2048 and cfg.warm_models == "a,b" and cfg.model == ""
    with pytest.raises(SystemExit):
        load_config(EngineConfig, "LLMSERVE_ENGINE", ["--memory-budget-mb", "0"])
    assert "--memory-budget-mb" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_config(EngineConfig, "LLMSERVE_ENGINE", ["--worker", "w:1"])  # an external worker serves one model
    assert "--model" in capsys.readouterr().err


def test_security_and_drain_flags_are_validated_at_start(capsys):
    for argv, flag in ((["--no-tls-client-auth"], "--no-tls-client-auth"),
                       (["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"], "--tls-cert"),
                       (["--tls-cert", "/nonexistent.pem"], "--tls-key"),
                       (["--drain-seconds", "-1"], "--drain-seconds")):
        with pytest.raises(SystemExit):
            load_config(RouterConfig, "LLMSERVE_ROUTER", argv)
        assert flag in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        load_config(EngineConfig, "LLMSERVE_ENGINE", ["--worker-secret-file", "/x"])
    assert "--worker-secret-file" in capsys.readouterr().err


def test_the_kv_pool_follows_the_memory_budget_unless_given():
    assert load_config(EngineConfig, "LLMSERVE_ENGINE", []).kv_pool_mb == 1024                  # 4096 / 4
    assert load_config(EngineConfig, "LLMSERVE_ENGINE", ["--memory-budget-mb", "64000"]).kv_pool_mb == 4096
    assert load_config(EngineConfig, "LLMSERVE_ENGINE", ["--kv-cache-mb", "256"]).kv_pool_mb == 256
    assert load_config(EngineConfig, "LLMSERVE_ENGINE", ["--dtype", "native"]).dtype == "native"


def test_the_kv_cache_dtype_is_one_of_its_choices_and_for_native_workers_only(capsys):
    from services.engine.models.worker_process import WorkerSpec
    from services.worker.config import WorkerConfig

    assert load_config(EngineConfig, "LLMSERVE_ENGINE", []).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        load_config(EngineConfig, "LLMSERVE_ENGINE", ["--kv-cache-dtype", "int4"])
    assert "--kv-cache-dtype must be one of auto, float16, int8-values" in capsys.readouterr().err
    cfg = load_config(WorkerConfig, "LLMSERVE_WORKER", ["--dtype", "native", "--kv-cache-dtype", "float16"])
    assert cfg.kv_cache_dtype == "float16"
    with pytest.raises(SystemExit):
        load_config(WorkerConfig, "LLMSERVE_WORKER", ["--dtype", "float32", "--kv-cache-dtype", "int8-values"])
    assert "--kv-cache-dtype applies to --dtype native" in capsys.readouterr().err
    args = WorkerSpec(model="smollm2", dtype="native", kv_cache_dtype="int8-values").args()
    assert args[args.index("--kv-cache-dtype") + 1] == "int8-values"


def test_the_speculation_gate_steps_leave_the_faster_side_most_decisions(capsys):
    """The gate retries the slower side in the last --speculative-gate-steps decisions of every 512: more than half
    of them would run the slower side most of the time, so such a value is refused."""
    assert load_config(EngineConfig, "LLMSERVE_ENGINE", ["--speculative-gate-steps", "256"]).speculative_gate_steps == 256
    for bad in ("257", "-1"):
        with pytest.raises(SystemExit):
            load_config(EngineConfig, "LLMSERVE_ENGINE", ["--speculative-gate-steps", bad])
        assert "--speculative-gate-steps must be in [0, 256]" in capsys.readouterr().err
