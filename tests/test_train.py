"""Training: the MTP loss pairing, the aux-loss-free bias rule, MTP-only fine-tuning, the corpus split."""

import os

import jax
import numpy as np
import pytest

import jaxmtp
from jaxmtp import data
from jaxmtp.train import TrainConfig, distillation, forward_losses, train, update_biases

TINY = jaxmtp.ModelConfig.from_hf_config("configs/tiny.json")


def _periodic_tokens(period=7, length=4000, seed=0):
    """A stream that repeats a random phrase: every token is predictable one and two steps ahead."""
    phrase = np.random.default_rng(seed).integers(2, TINY.vocab_size, period)
    return np.tile(phrase, length // period).astype(np.int32)


def test_mtp_loss_predicts_two_ahead_from_hidden_and_next_token():
    """The MTP cross-entropy equals the one computed by hand from Model.forward / mtp_forward with
    slot p given (h_p, t_{p+1}) and scored on t_{p+2}."""
    model = jaxmtp.init(TINY, seed=1)
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 18)).astype(np.int32)
    main, mtp, _, _, _ = forward_losses(model.params, tokens, TINY, mtp_only=False)
    logits, hidden = model.forward(tokens[:, :-2])
    mtp_logits = np.asarray(model.mtp_forward(hidden, tokens[:, 1:-1]), np.float64)

    def ce(lg, targets):
        lg = lg - lg.max(-1, keepdims=True)
        logp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
        return -np.take_along_axis(logp, targets[..., None], -1).mean()

    np.testing.assert_allclose(float(main), ce(np.asarray(logits, np.float64), tokens[:, 1:-1]), rtol=1e-5)
    np.testing.assert_allclose(float(mtp), ce(mtp_logits, tokens[:, 2:]), rtol=1e-5)


def test_bias_update_moves_towards_underloaded_experts():
    model = jaxmtp.init(TINY, seed=0)
    moe_load = np.array([[5, 0, 3, 0, 0, 8, 0, 0]] * TINY.num_moe_layers)  # [L, E], mean 2
    mtp_load = np.array([2, 2, 2, 2, 0, 0, 4, 4])  # mean 2
    loads = {"moe_layers": {"layers": {"mlp": {"expert_load": (moe_load,)}}},
             "mtp": {"block": {"mlp": {"expert_load": (mtp_load,)}}}}
    new = update_biases(model.params, loads, 0.01, mtp_only=False)
    moe_bias = np.asarray(new["moe_layers"]["layers"]["mlp"]["gate"]["e_score_correction_bias"])
    np.testing.assert_allclose(moe_bias, 0.01 * np.sign(2 - moe_load), atol=1e-7)
    mtp_bias = np.asarray(new["mtp"]["block"]["mlp"]["gate"]["e_score_correction_bias"])
    np.testing.assert_allclose(mtp_bias, [0, 0, 0, 0, 0.01, 0.01, -0.01, -0.01], atol=1e-7)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("train") / "log.jsonl")
    cfg = TrainConfig(steps=60, batch=4, seq_len=32, learning_rate=1e-2, warmup=5, bias_rate=1e-2)
    model, log = train(jaxmtp.init(TINY, seed=0), _periodic_tokens(), cfg, log_path, quiet=True)
    return model, log, log_path


def test_training_learns_a_periodic_stream_and_balances_experts(trained):
    model, log, log_path = trained
    first, last = log[0], log[-1]
    assert first["main_loss"] > 5.5 and first["mtp_loss"] > 5.5  # ~ log(512) at random init
    assert last["main_loss"] < 1.0 and last["mtp_loss"] < 1.0, last
    assert len(open(log_path).readlines()) == len(log)
    bias = np.asarray(model.params["moe_layers"]["layers"]["mlp"]["gate"]["e_score_correction_bias"])
    assert np.abs(bias).max() > 0  # the aux-loss-free rule ran


def test_distillation_is_cross_entropy_to_the_main_models_next_prediction():
    rng = np.random.default_rng(3)
    logits, mtp_logits = rng.normal(size=(2, 2, 6, 11)).astype(np.float32)
    target = np.exp(logits[:, 1:]) / np.exp(logits[:, 1:]).sum(-1, keepdims=True)
    log_q = mtp_logits[:, :-1] - np.log(np.exp(mtp_logits[:, :-1]).sum(-1, keepdims=True))
    np.testing.assert_allclose(float(distillation(logits, mtp_logits)), -(target * log_q).sum(-1).mean(), rtol=1e-5)


def test_mtp_only_changes_only_the_mtp_module(trained):
    model = trained[0]
    tokens = _periodic_tokens(seed=1)
    tuned, log = train(model, tokens, TrainConfig(steps=20, batch=4, seq_len=32, learning_rate=1e-2, warmup=2,
                                                  mtp_only=True), quiet=True)
    for key in model.params:
        same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), model.params[key], tuned.params[key])
        assert all(jax.tree.leaves(same)) == (key != "mtp"), key
    assert log[-1]["mtp_loss"] < log[0]["mtp_loss"]


def test_corpus_excludes_tests_and_holds_out_fixed_modules():
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    train_files, held_out = data.source_files()
    assert len(train_files) > 500 and held_out and not set(train_files) & set(held_out)
    top = lambda path: os.path.relpath(path, root).split(os.sep)[0].removesuffix(".py")  # noqa: E731
    assert {top(p) for p in held_out} == set(data.HELD_OUT_MODULES)
    assert not {top(p) for p in train_files} & set(data.HELD_OUT_MODULES)
    for path in train_files + held_out:
        parts = os.path.relpath(path, root).split(os.sep)
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts) and not parts[-1].startswith("test_")
