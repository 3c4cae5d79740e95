"""reranker.decoding: the one owner of the decode settings (defaults, bounds, validation, flags, the
model's recorded settings), and the places that read it: the service's proto options and batch key,
the pipeline's evaluation settings."""
from __future__ import annotations

import argparse
import json

import pytest

from reranker.decoding import (COMMIT_RULES, DEFAULT_COMMIT_RULE, DEFAULT_TAU, MODEL_CONFIG_KEY, DecodeOptions,
                               DecodeSettingError, add_decode_flags, explicit_from_args, record, recorded_in,
                               resolve, served_rollout_settings)


def test_explicit_over_recorded_over_defaults():
    assert resolve() == DecodeOptions()
    assert (DecodeOptions().tau, DecodeOptions().commit_rule) == (DEFAULT_TAU, DEFAULT_COMMIT_RULE)
    recorded = {"decoder": "diffusion", "commit_rule": "prefix", "tau": 0.5}
    got = resolve({"tau": 0.7, "commit_rule": None}, recorded)  # None: not given
    assert (got.decoder, got.commit_rule, got.tau, got.hold_eos) == ("diffusion", "prefix", 0.7, False)
    with pytest.raises(ValueError, match=r"unknown decode setting\(s\) \['taus'\]"):
        resolve({"taus": 0.7})


def test_training_rollouts_decode_as_the_student_is_served():
    """OPD and RL roll out with the student's recorded tau and commit rule unless their config sets them."""
    class Config:
        pass

    student = Config()
    assert served_rollout_settings({"tau": None, "commit_rule": None}, student) == {
        "tau": DEFAULT_TAU, "commit_rule": DEFAULT_COMMIT_RULE}
    record(student, {"decoder": "diffusion", "commit_rule": "prefix", "tau": 0.8})
    assert served_rollout_settings({"tau": None, "commit_rule": None}, student) == {"tau": 0.8, "commit_rule": "prefix"}
    assert served_rollout_settings({"tau": 0.95, "commit_rule": "confidence"}, student) == {
        "tau": 0.95, "commit_rule": "confidence"}


@pytest.mark.parametrize("field,value,message", [
    ("decoder", "beam", "decoder: must be one of ('ar', 'ar_lookup', 'diffusion'), got 'beam'"),
    ("tau", 0.0, "tau: must be in (0, 1], got 0.0"),
    ("tau", float("nan"), "tau: must be in (0, 1], got nan"),
    ("block_size", 257, "block_size: must be in [1, 256] or unset, got 257"),
    ("temperature", -1.0, "temperature: must be a finite number >= 0, got -1.0"),
    ("max_new_tokens", 0, "max_new_tokens: must be an integer >= 1, got 0"),
    ("max_steps_per_block", 0, "max_steps_per_block: must be an integer >= 1 or unset, got 0"),
    ("commit_rule", "left", f"commit_rule: must be one of {COMMIT_RULES}, got 'left'"),
    ("hold_eos", "yes", "hold_eos: must be true or false, got 'yes'"),
    ("compute_dtype", "float16", "compute_dtype: must be one of ('float32', 'bfloat16'), got 'float16'"),
])
def test_one_validation_names_the_field_and_value(field, value, message):
    with pytest.raises(DecodeSettingError) as e:
        DecodeOptions(**{field: value}).validate("options.")
    assert str(e.value) == "options." + message and e.value.field == "options." + field


def test_the_key_is_every_setting():
    base = DecodeOptions(decoder="diffusion")
    for change in ({"commit_rule": "prefix"}, {"hold_eos": True}, {"temperature": 0.5}, {"tau": 0.8},
                   {"block_size": 8}, {"max_new_tokens": 10}, {"seed": 1}, {"max_steps_per_block": 2},
                   {"compute_dtype": "bfloat16"}):
        assert resolve({**base.as_dict(), **change}).key != base.key, change


def test_a_setting_keyed_later_enters_step_keys_only_away_from_its_default():
    """Pipeline steps hash hash_dict(): a finished run keeps its keys when a setting is added, and a run
    that uses the new setting gets new ones."""
    base = DecodeOptions(decoder="diffusion", commit_rule="prefix")
    assert "compute_dtype" not in base.hash_dict()
    assert base.hash_dict() == {k: v for k, v in base.as_dict().items() if k != "compute_dtype"}
    assert resolve({**base.as_dict(), "compute_dtype": "bfloat16"}).hash_dict()["compute_dtype"] == "bfloat16"


def test_a_model_records_its_settings(tmp_path):
    with pytest.raises(ValueError, match="config.json: cannot read the model config"):
        recorded_in(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert recorded_in(tmp_path) == {}

    class Config:  # an HF config: settings are attributes
        pass

    config = Config()
    assert record(config, {"decoder": "diffusion", "tau": None}) == {"decoder": "diffusion"}
    assert record(config, {"commit_rule": "prefix"}) == {"decoder": "diffusion", "commit_rule": "prefix"}
    (tmp_path / "config.json").write_text(json.dumps({MODEL_CONFIG_KEY: config.decode_settings}))
    assert recorded_in(tmp_path) == {"decoder": "diffusion", "commit_rule": "prefix"}
    with pytest.raises(ValueError, match="unknown setting"):
        record(config, {"seed": 3})  # a run setting, not a model's
    (tmp_path / "config.json").write_text(json.dumps({MODEL_CONFIG_KEY: {"tau": 2}}))
    with pytest.raises(ValueError, match=r"config.json: decode_settings.tau: must be in \(0, 1\], got 2"):
        recorded_in(tmp_path)


def test_flags_default_to_not_given():
    p = argparse.ArgumentParser()
    add_decode_flags(p)
    assert explicit_from_args(p.parse_args([])) == {}
    args = p.parse_args(["--tau", "0.5", "--commit-rule", "prefix", "--no-hold-eos", "--decoder", "diffusion"])
    assert explicit_from_args(args) == {"tau": 0.5, "commit_rule": "prefix", "hold_eos": False,
                                        "decoder": "diffusion"}
    with pytest.raises(SystemExit):
        p.parse_args(["--commit-rule", "left"])


def test_service_options_read_the_new_fields_and_key_on_them():
    from proto.diffusion_gr2.v1 import reranker_pb2 as pb
    from reranker.service.options import ServiceLimits
    from reranker.service.validation import ValidationError, validate_options

    lim = ServiceLimits(max_new_tokens=64)
    defaults = DecodeOptions(decoder="diffusion", commit_rule="prefix", max_new_tokens=32)
    unset, _, _ = validate_options(pb.DecodeOptions(), lim, True, 5, defaults)
    assert unset == defaults  # nothing sent: the server's defaults (the model's record)
    sent, _, _ = validate_options(pb.DecodeOptions(commit_rule=pb.COMMIT_RULE_CONFIDENCE, hold_eos=True, tau=0.3),
                                  lim, True, 5, defaults)
    assert (sent.commit_rule, sent.hold_eos, sent.tau) == ("confidence", True, 0.3)  # 0.3 exactly, not float32's
    off, _, _ = validate_options(pb.DecodeOptions(hold_eos=False), lim, True, 5,
                                 DecodeOptions(decoder="diffusion", hold_eos=True))
    assert off.hold_eos is False  # proto3 optional: an explicit false is not "unset"
    assert len({unset.key, sent.key}) == 2
    with pytest.raises(ValidationError, match=r"^options.tau: must be in \(0, 1\], got 1.5"):
        validate_options(pb.DecodeOptions(tau=1.5), lim, True, 5, defaults)
    with pytest.raises(ValidationError, match=r"^options.decoder: diffusion needs a converted model"):
        validate_options(pb.DecodeOptions(), lim, False, 5, defaults)


def test_pipeline_eval_settings_resolve_against_the_model(tmp_path):
    from integration.pipeline import _decode_options

    (tmp_path / "config.json").write_text(json.dumps({MODEL_CONFIG_KEY: {"commit_rule": "prefix", "tau": 0.5}}))
    opts = _decode_options({"tau": 0.8, "max_new_tokens": 64}, "diffusion", tmp_path)
    assert (opts.decoder, opts.tau, opts.commit_rule, opts.max_new_tokens) == ("diffusion", 0.8, "prefix", 64)
    ar = _decode_options({"commit_rule": "prefix", "hold_eos": True}, "ar")
    assert (ar.decoder, ar.commit_rule, ar.hold_eos) == ("ar", DEFAULT_COMMIT_RULE, False)  # AR ignores them
    with pytest.raises(ValueError, match="tau: must be in"):
        _decode_options({"tau": 0}, "diffusion")


def test_client_sends_the_new_fields_only_when_given():
    from proto.diffusion_gr2.v1 import reranker_pb2 as pb
    from reranker.service.client import decode_options

    none = decode_options()
    assert none.commit_rule == pb.COMMIT_RULE_UNSPECIFIED and not none.HasField("hold_eos")
    some = decode_options(decoder="diffusion", commit_rule="prefix", hold_eos=False)
    assert some.commit_rule == pb.COMMIT_RULE_PREFIX and some.HasField("hold_eos") and some.hold_eos is False
    with pytest.raises(ValueError, match="commit_rule must be one of"):
        decode_options(commit_rule="left")


def test_ar_lookup_is_greedy_only():
    """Its drafts are kept where they equal the arg-max: a sampled decode would not be the model's."""
    assert DecodeOptions(decoder="ar_lookup").validate().temperature == 0.0
    with pytest.raises(DecodeSettingError, match=r"^temperature: must be 0 with decoder 'ar_lookup'"):
        DecodeOptions(decoder="ar_lookup", temperature=0.7).validate()
    with pytest.raises(ValueError, match="ar_lookup"):
        resolve({"decoder": "ar_lookup"}, {"decoder": "ar", "temperature": 0.5})  # a recorded temperature too
    assert resolve({"decoder": "ar_lookup", "temperature": 0.0}, {"temperature": 0.5}).decoder == "ar_lookup"
