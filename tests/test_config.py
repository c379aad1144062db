import re
from pathlib import Path

import pytest

from trainapp import config
from trainapp.cli import reference_markdown
from trainapp.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_defaults_are_the_built_in_cpu_run():
    cfg = config.load()
    assert cfg.data.name == "synthetic" and cfg.model.name == "smallcnn"
    assert cfg.amp.dtype == "auto" and cfg.train.max_steps is None and cfg.snapshot.keep >= 1


def test_cli_overrides_beat_the_file_which_beats_the_defaults(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("seed: 7\ntrain:\n  epochs: 5\n  batch_size: 16\noptim:\n  lr: 0.2\n")
    cfg = config.load(f, ["train.batch_size=8", "optim.lr=1e-3"])
    assert cfg.seed == 7 and cfg.train.epochs == 5  # file over defaults
    assert cfg.train.batch_size == 8 and cfg.optim.lr == pytest.approx(1e-3)  # CLI over file
    assert cfg.train.grad_accum == 1  # untouched default


def test_override_values_are_parsed_as_yaml():
    cfg = config.load(None, ["optim.lr_mult={fc: 10, features.0: 0.5}", "train.max_steps=null",
                             "train.progress=false", "run.dir=123"])
    assert cfg.optim.lr_mult == {"fc": 10.0, "features.0": 0.5}
    assert cfg.train.max_steps is None and cfg.train.progress is False
    assert cfg.run.dir == "123"  # a string field keeps a number-looking value as text


def test_unknown_key_is_rejected_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown key train\.epoch; did you mean train\.epochs\?"):
        config.load(None, ["train.epoch=3"])
    with pytest.raises(ConfigError, match=r"unknown key bogus;"):
        config.load(None, ["bogus.key=1"])


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError, match=r"^train\.batch_size='many': input should be a valid integer"):
        config.load(None, ["train.batch_size=many"])
    with pytest.raises(ConfigError, match=r"^train\.max_steps=2\.5: "):
        config.load(None, ["train.max_steps=2.5"])


@pytest.mark.parametrize("item, key", [
    ("train.grad_accum=0", "train.grad_accum"),
    ("train.batch_size=-4", "train.batch_size"),
    ("optim.lr=0", "optim.lr"),
    ("snapshot.keep=0", "snapshot.keep"),
    ("train.ema_decay=1.0", "train.ema_decay"),
    ("amp.dtype=fp8", "amp.dtype"),
    ("optim.lr_scaling=cubic", "optim.lr_scaling"),
    ("data.name=imagenet", "data.name"),
    ("dist.timeout_s=0", "dist.timeout_s"),
])
def test_out_of_range_values_are_rejected(item, key):
    with pytest.raises(ConfigError) as e:
        config.load(None, [item])
    msg = str(e.value)
    assert msg.startswith(key + "=") and "\n" not in msg


def test_cross_field_check_names_both_settings():
    with pytest.raises(ConfigError, match=r"model\.num_classes=3: .*data\.synthetic_classes=10"):
        config.load(None, ["model.num_classes=3"])


def test_override_without_equals_sign_is_rejected():
    with pytest.raises(ConfigError, match=r"override 'train\.max_steps': expected KEY=VALUE"):
        config.load(None, ["train.max_steps"])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"--config .*nope\.yaml: no such file"):
        config.load(tmp_path / "nope.yaml")


def test_malformed_yaml_names_the_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  epochs: 2\n  batch_size: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML at line \d+"):
        config.load(f)


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    f = tmp_path / "list.yaml"
    f.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        config.load(f)


def test_section_given_a_scalar_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"^train=3: must be a mapping"):
        config.load(None, ["train=3"])


def test_every_field_has_a_docstring():
    table = reference_markdown()
    rows = [r for r in table.splitlines()[2:]]
    assert len(rows) >= 35
    empty = [r for r in rows if r.rstrip().endswith("|  |")]
    assert not empty, empty


def test_docs_configuration_reference_is_current():
    page = (REPO / "docs" / "configuration.md").read_text()
    assert reference_markdown() in page, (
        "docs/configuration.md is stale: paste `make config-reference` into it")


def test_shipped_configs_are_valid():
    files = sorted((REPO / "configs").glob("*.yaml"))
    assert files, "configs/ should hold example configs"
    for f in files:
        config.load(f)


def test_resolved_config_round_trips_through_a_dict():
    cfg = config.load(None, ["optim.lr_mult={fc: 2}", "train.max_steps=9"])
    assert config.from_dict(cfg.to_dict()) == cfg
    assert re.search(r"max_steps", str(cfg.to_dict()))
