"""The run config: YAML + dotted overrides, typed, validated once with errors that name the field."""

from pathlib import Path

import pytest

from megacispo.config import Config, load_config, parse_override, to_dict

EXAMPLES = sorted((Path(__file__).parent.parent / "examples" / "configs").glob("*.yaml"))


def test_defaults_are_the_m1_recipe():
    config = load_config(None)
    assert config.rl.loss.name == "cispo"
    assert config.rl.loss.params["eps_low"] == 1.0 and config.rl.loss.params["eps_high"] == 4.0
    assert (config.optimizer.adam_beta1, config.optimizer.adam_beta2, config.optimizer.adam_eps) == (0.9, 0.95, 1e-15)
    assert config.model.num_layers == 8 and config.model.layer_pattern.startswith("LLLLLLLS")


def test_yaml_and_dotted_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  size: tiny\n  num_layers: 16\nrl:\n  loss:\n    name: dapo\ntrain:\n  steps: 3\n")
    config = load_config(str(path), ["train.steps=5", "rl.loss.params.eps_high=0.3", "optimizer.lr=1e-3",
                                      "parallel.sequence_parallel=true", "parallel.tensor_model_parallel_size=2"])
    assert config.model.num_layers == 16
    assert config.train.steps == 5
    assert config.rl.loss.name == "dapo" and config.rl.loss.params == {"eps_low": 0.2, "eps_high": 0.3}
    assert config.optimizer.lr == 1e-3 and isinstance(config.optimizer.lr, float)
    assert config.parallel.sequence_parallel is True


def test_resolved_config_round_trips():
    config = load_config(None, ["train.steps=7"])
    assert isinstance(to_dict(config)["model"], dict)
    assert to_dict(config)["train"]["steps"] == 7


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.grup_size=4", r"config.rollout.grup_size: unknown field; valid fields of config.rollout: .*group_size"),
        ("train.steps=many", r"config.train.steps: expected int, got 'many'"),
        ("train.steps=0", r"train.steps = 0: it must be at least 1"),
        ("sft.decay_steps=-5", r"sft.decay_steps = -5: it must be >= 0"),
        ("rollout.group_size=1", r"rollout.group_size = 1"),
        ("rollout.top_p=1.5", r"rollout.top_p = 1.5"),
        ("rl.updates_per_rollout=3", r"rl.updates_per_rollout = 3 does not divide the rollout batch"),
        ("rl.loss.name=ppo", r"rl.loss: .*'ppo'.*cispo"),
        ("rl.loss.params.eps_hgh=1", r"rl.loss: unknown parameter\(s\) eps_hgh"),
        ("rl.old_logprobs=cached", r"rl.old_logprobs = 'cached'"),
        ("model.size=huge", r"config.model: model size 'huge' is unknown"),
        ("model.num_layrs=2", r"config.model.num_layrs: unknown field"),
        ("parallel.tensor_model_parallel_size=two", r"config.parallel.tensor_model_parallel_size: expected int"),
    ],
)
def test_bad_config_names_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_override_syntax_and_missing_file():
    with pytest.raises(ValueError, match="expected key=value"):
        parse_override("train.steps")
    with pytest.raises(ValueError, match="no such file"):
        load_config("/nonexistent/run.yaml")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_configs_load(path):
    assert isinstance(load_config(str(path)), Config)


@pytest.mark.parametrize(
    "layout, message",
    [
        ("parallel.expert_model_parallel_size=2", r"needs parallel.expert_model_parallel_size = 1, got 2"),
        ("parallel.tensor_model_parallel_size=2", r"needs parallel.tensor_model_parallel_size = 1, got 2"),
        ("parallel.pipeline_model_parallel_size=2", r"needs parallel.pipeline_model_parallel_size = 1, got 2"),
        ("precision.use_transformer_engine=true", r"needs precision.transformer_engine = False, got True"),
    ],
)
def test_compile_decode_refuses_a_layout_it_cannot_trace(layout, message):
    load_config(None, [layout])  # the layout alone is valid
    with pytest.raises(ValueError, match=rf"rollout.compile_decode = true {message}.*rollout.compile_decode=false"):
        load_config(None, ["rollout.compile_decode=true", layout])
    assert load_config(None, ["rollout.compile_decode=true"]).rollout.compile_decode
