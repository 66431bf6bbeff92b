"""DeepSeek-V4: the trunk against transformers' DeepseekV4ForCausalLM, the MTP block against a torch
reference written from DeepSeek's MTPBlock, caches stored by position (chunked prefill and decode
equal one pass), speculative greedy equal to plain greedy, speculative sampling
against the model's distribution, and the configs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmtp import CONFIGS
from jaxmtp.errors import CheckpointError, ConfigError, InputError
from jaxmtp.models.deepseek_v4 import CSA, HCA, SLIDING, V4Config, V4Model, init_v4
from jaxmtp.models.deepseek_v4.names import params_from_hf
from jaxmtp.models.deepseek_v4.speculative import generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers without DeepseekV4ForCausalLM", allow_module_level=True)

TINY = dict(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
            q_lora_rank=32, partial_rotary_factor=8 / 32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16, hc_mult=4, initializer_range=0.1,
            max_position_embeddings=4096)
# Each config crosses the sliding window and several compressed entries within 45 positions; index_topk
# below the number of entries makes the indexer choose. 16 index heads make an exact tie of scores at
# relu's zero (every head negative), where two implementations' top-k may pick differently, unlikely.
CONFIGS_HF = {
    # every attention kind, hash layers first
    "kinds": dict(layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
                  sliding_window=8, compress_rates={CSA: 4, HCA: 8}, index_topk=3),
    # V4-Pro's pattern (two HCA hash layers, looped, then CSA), YaRN on the compressed layers
    "pro_yarn": dict(layer_types=[HCA, HCA, CSA, HCA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
                     sliding_window=6, compress_rates={CSA: 4, HCA: 16}, index_topk=2,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                      "beta_fast": 32, "beta_slow": 1}),
    # two streams, the indexer keeping more entries, V4-Flash's (HCA, CSA) pair repeated: it runs in a
    # loop over stacked parameters (transformer.segments)
    "two_streams": dict(layer_types=[HCA, CSA, HCA, CSA], mlp_layer_types=["moe"] * 4,
                        sliding_window=8, compress_rates={CSA: 4, HCA: 8}, index_topk=4, hc_mult=2),
}


def hf_model(name, seed=0):
    """A random DeepseekV4ForCausalLM in float32, with the parameters its init leaves constant (sinks,
    position and stream biases, the hash table, the routing bias) random too."""
    settings = dict(TINY, **CONFIGS_HF[name])
    settings["num_hidden_layers"] = len(settings["layer_types"])
    torch.manual_seed(seed)
    config = transformers.DeepseekV4Config(**settings)
    model = transformers.DeepseekV4ForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("position_bias", "sinks", "hc.base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif pname.endswith(("hc.scale", "hc_scale")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        for bname, buf in model.named_buffers():
            if bname.endswith("tid2eid"):
                buf.copy_(torch.stack([torch.randperm(config.n_routed_experts, generator=g)[:config.num_experts_per_tok]
                                       for _ in range(config.vocab_size)]))
            elif bname.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
    return settings, model


def ours(settings, hf):
    config = V4Config.from_hf_config(hf.config.to_dict())
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    return V4Model(config, jax.tree.map(jnp.asarray, params_from_hf(config, state)))


@pytest.fixture(scope="module", params=sorted(CONFIGS_HF))
def pair(request):
    settings, hf = hf_model(request.param)
    return hf, ours(settings, hf)


def test_logits_and_hidden_match_transformers_on_a_ragged_batch(pair):
    hf, model = pair
    lengths = [45, 30, 13]
    tokens = np.random.default_rng(0).integers(0, 256, (3, 45))
    logits, hidden = model.forward(tokens, lengths)
    for row, n in enumerate(lengths):
        with torch.no_grad():
            ref = hf(torch.tensor(tokens[row:row + 1, :n]), output_hidden_states=True)
        np.testing.assert_allclose(np.asarray(logits[row, :n]), ref.logits[0].numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(np.asarray(hidden[row, :n]), ref.hidden_states[-1][0].numpy(), atol=1e-4, rtol=0)


def test_decode_steps_through_the_cache_match_transformers(pair):
    """Chunks of 1 position: decode steps."""
    _chunks_match(*pair, chunk=1)


def test_prefill_chunks_through_the_cache_match_transformers():
    """Chunks of 7 close compressed entries mid-chunk and leave partial windows between chunks."""
    settings, hf = hf_model("kinds")
    _chunks_match(hf, ours(settings, hf), chunk=7)


def _chunks_match(hf, model, chunk):
    lengths = np.array([33, 20])
    tokens = np.random.default_rng(1).integers(0, 256, (2, 35))
    caches = model.new_caches(2, 40)
    pieces = []
    for at in range(0, 35, chunk):
        logits, _, _, caches = model.step(tokens[:, at:at + chunk], np.full(2, at), np.clip(lengths - at, 0, chunk),
                                          caches)
        pieces.append(np.asarray(logits))
    logits = np.concatenate(pieces, axis=1)
    for row, n in enumerate(lengths):
        with torch.no_grad():
            ref = hf(torch.tensor(tokens[row:row + 1, :n])).logits[0].numpy()
        np.testing.assert_allclose(logits[row, :n], ref, atol=1e-4, rtol=0)


def test_greedy_matches_transformers_generate():
    settings, hf = hf_model("kinds", seed=5)
    model = ours(settings, hf)
    prompts = [list(range(3, 40)), [7, 9, 11, 200, 5]]
    tokens = model.greedy(prompts, 24, chunk=16)
    for prompt, got in zip(prompts, tokens):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        assert got == want[0, len(prompt):].tolist()


def reference_mtp(hf_layer, hf_rotary, weights, streams, next_ids, eps):
    """DeepSeek's MTPBlock.forward, written in torch: e = enorm(embed(next)); x = e_proj(e) broadcast over
    the streams + h_proj(hnorm(streams)); x = Block(x) (here transformers' V4 decoder layer, sliding
    window, top-k routed); logits = head(norm(hc_head(x)))."""
    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    e = rms(weights["embed"][next_ids], weights["enorm"])
    x = (e @ weights["e_proj"].T)[:, :, None, :] + rms(streams, weights["hnorm"]) @ weights["h_proj"].T
    positions = torch.arange(streams.shape[1])[None]
    window = hf_layer.self_attn.sliding_window
    i, j = positions[0][:, None], positions[0][None, :]
    mask = torch.where((j <= i) & (j > i - window), 0.0, float("-inf"))[None, None]
    rope = {"main": hf_rotary(x, positions, layer_type="main")}
    x = hf_layer(x, position_embeddings=rope, position_ids=positions, attention_mask=mask, input_ids=next_ids)
    flat = x.flatten(2)
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid(flat @ weights["hc_fn"].T * weights["hc_scale"] + weights["hc_base"]) + 1e-6
    h = rms((pre[..., None] * x).sum(2), weights["norm"])
    return h @ weights["head"].T


def test_mtp_block_matches_deepseeks_formulas_on_four_streams():
    # One main layer of the block's own kind: the block reads the main model's embedding and head only.
    settings = dict(TINY, **dict(CONFIGS_HF["kinds"], layer_types=[SLIDING], mlp_layer_types=["moe"]),
                    num_hidden_layers=1)
    model = init_v4(V4Config.from_hf_config(dict(settings, model_type="deepseek_v4")), seed=3)
    c = model.config
    mtp = jax.tree.map(lambda a: torch.tensor(np.asarray(a, np.float32)), model.params["mtp"])
    rng = np.random.default_rng(2)
    mtp["hc_head"]["hc_base"] = torch.tensor(rng.normal(size=c.hc_mult), dtype=torch.float32)
    mtp["block"]["self_attn"]["sinks"] = torch.tensor(rng.normal(size=c.num_attention_heads), dtype=torch.float32)
    params = dict(model.params, mtp=jax.tree.map(lambda t: jnp.asarray(t.numpy()), mtp))
    model = V4Model(c, params)
    # transformers' decoder layer as the block: a sliding, top-k routed layer with the MTP block's weights
    hf_config = transformers.DeepseekV4Config(**settings)
    layer = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4DecoderLayer(hf_config, 0).float().eval()
    rotary = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RotaryEmbedding(hf_config)
    state = {".".join(p.key for p in path): value for path, value in jax.tree_util.tree_leaves_with_path(mtp["block"])}
    state["mlp.experts.gate_up_proj"] = torch.cat([state.pop("mlp.experts.gate_proj"),
                                                   state.pop("mlp.experts.up_proj")], dim=1)
    missing, unexpected = layer.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"mlp.gate.tid2eid"}, (missing, unexpected)
    weights = dict(embed=torch.tensor(np.asarray(model.params["embed_tokens"]["weight"])),
                   head=torch.tensor(np.asarray(model.params["lm_head"]["weight"])),
                   enorm=mtp["enorm"]["weight"], hnorm=mtp["hnorm"]["weight"], norm=mtp["norm"]["weight"],
                   e_proj=mtp["e_proj"]["weight"], h_proj=mtp["h_proj"]["weight"], **mtp["hc_head"])
    streams = rng.normal(size=(2, 20, c.hc_mult, c.hidden_size)).astype(np.float32)
    next_ids = rng.integers(0, c.vocab_size, (2, 20))
    with torch.no_grad():
        want = reference_mtp(layer, rotary, weights, torch.tensor(streams), torch.tensor(next_ids), c.rms_norm_eps)
    got, _, _ = model.mtp_step(streams, next_ids, np.zeros(2), np.full(2, 20), model.new_mtp_cache(2, 20))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-4, rtol=0)


# A small vocabulary makes the random MTP block's drafts right often enough that rounds accept one,
# two or more drafts as well as rejecting them.
DRAFTING = V4Config(vocab_size=8, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=2, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,
                    layer_types=(CSA, HCA), mlp_layer_types=("hash_moe", "moe"), head_dim=16, qk_rope_head_dim=4,
                    sliding_window=6, compress_rates=(4, 8), o_groups=2, o_lora_rank=8, index_n_heads=8,
                    index_head_dim=8, index_topk=2, hc_mult=2, initializer_range=0.3)


def test_speculative_greedy_is_plain_greedy_across_window_and_compression_boundaries():
    """Rounds that accept several drafts and rounds that reject (DRAFTING), EOS ids, stop sequences
    and strings, log-probabilities, auto, and the property on seeded random prompts and k."""
    model = init_v4(DRAFTING, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 8, n).tolist() for n in (5, 17, 11)]
    plain = model.greedy(prompts, 30)
    sizes = dict(cache_len=200, headroom=5)  # one cache shape: the rounds at each k compile once
    for k in (0, 1, 2, 3):
        out = generate(model, prompts, 30, k, **sizes)
        tokens, accepted = out.tokens, np.array([a for _, a in out.rounds])
        assert tokens == plain, k
        assert (accepted == 0).any() and ((accepted >= 1).any() or k == 0), k
    assert (accepted >= 2).any()
    # auto: k chosen per segment from the acceptance so far and these round costs (in plain rounds)
    out = generate(model, prompts, 30, "auto", k_max=3, costs=[1.0, 1.2, 1.4, 1.6], **sizes)
    assert out.tokens == plain
    assert len({k for k, _ in out.rounds}) > 1
    # each token's log-probability is the main model's log-softmax at its position, from one whole pass
    logits, _ = model.forward([prompts[1] + plain[1]])
    want = jax.nn.log_softmax(np.asarray(logits[0]), axis=-1)
    at = np.arange(len(prompts[1]) - 1, len(prompts[1]) + 29)
    np.testing.assert_allclose(out.logprobs[1], np.asarray(want)[at, plain[1]], atol=1e-4)
    # stop ids end a row after the first (kept); prefilled in chunks of 4
    stop = plain[1][5]
    tokens = generate(model, prompts, 30, 2, eos_token_id=[stop], prefill_chunk=4, **sizes).tokens
    assert tokens == [row[:row.index(stop) + 1] if stop in row else row for row in plain]
    # a stop sequence of two tokens, and a stop string in the decoded text (ids written as digits):
    # a row ends after the token that completes either (kept), wherever a round commits it
    pair, text = plain[0][7:9], " ".join(map(str, plain[2][10:13]))
    decoded = lambda ids: " ".join(map(str, ids))  # noqa: E731

    def cut(row, ends):
        return next((row[:e] for e in range(1, len(row) + 1) if ends(row[:e])), row)

    tokens = generate(model, prompts, 30, 3, stop_token_ids=[pair], **sizes).tokens
    assert tokens == [cut(row, lambda head: head[-2:] == pair) for row in plain]
    tokens = generate(model, prompts, 30, 3, stop=[text], tokenizer=type("Digits", (), {"decode": staticmethod(decoded)}),
                      **sizes).tokens
    assert tokens == [cut(row, lambda head: text in decoded(head)) for row in plain]
    assert len(tokens[2]) < 30
    with pytest.raises(InputError, match="stop strings need a tokenizer"):
        generate(model, prompts, 30, 3, stop=[text])
    # the property on random prompts and k (seeded; one row 17..20 long, so that every case
    # prefills in the shapes compiled above): speculative greedy equals plain greedy
    for _ in range(3):
        cases = [rng.integers(0, 8, n).tolist() for n in (rng.integers(17, 21), *rng.integers(1, 21, 2))]
        k = int(rng.integers(1, 5))
        out = generate(model, cases, 30, k, prefill_chunk=4, **sizes)
        assert out.tokens == generate(model, cases, 30, 0, prefill_chunk=4, **sizes).tokens, (cases, k)
        assert any(a.min() == 0 for _, a in out.rounds)  # rejections


def test_jaxmtp_generate_and_generate_stream_take_a_v4_model(monkeypatch, tmp_path):
    """jaxmtp.generate with a GenerationConfig's fields on a V4 model: speculative greedy (fixed k and
    auto) gives plain greedy's tokens, with the log-probabilities of speculative.generate, and the
    stats count the rounds that committed the tokens; generate_stream yields the same tokens
    and cuts its text before a stop string."""
    import jaxmtp
    from jaxmtp import calibration

    model = init_v4(DRAFTING, seed=1)
    prompts = [[1, 2, 3, 4, 5, 6, 7]]  # one row, as generate_stream's below: one set of programs (ragged rows: above)
    plain = model.greedy(prompts, 20)
    out = jaxmtp.generate(model, prompts, max_new_tokens=20, speculative_k=2, return_logprobs=True)
    assert out.tokens == plain
    s = out.stats
    for i, row in enumerate(out.tokens):  # the prefill's token, then accepted + 1 a round, the last cut at 20
        assert s.rounds[i] + s.accepted[i] + 1 - 2 <= len(row) <= s.rounds[i] + s.accepted[i] + 1
        assert s.drafted[i] == 2 * s.rounds[i] and sum(s.rounds_at[i]) == s.rounds[i]
    assert 0 < s.acceptance_rate < 1
    # the log-probabilities speculative.generate returns (checked against a whole forward pass in
    # the test above), here from the same compiled rounds
    assert out.logprobs == generate(model, prompts, 20, 2).logprobs
    # auto: round costs measured once (fewer timed rounds here) and kept on disk
    monkeypatch.setenv("JAXMTP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "ROUNDS", 4)
    monkeypatch.setattr(calibration, "REPEATS", 1)
    auto = jaxmtp.generate(model, prompts, max_new_tokens=20, speculative_k="auto")
    assert auto.tokens == plain and len(auto.stats.round_costs) == 3  # k = 0..2 on a CPU
    assert (tmp_path / calibration.FILE).exists()
    monkeypatch.setattr(calibration, "measure", lambda *args, **kwargs: pytest.fail("measured the costs again"))
    again = jaxmtp.generate(model, prompts, max_new_tokens=20, speculative_k="auto")
    assert again.stats.round_costs == auto.stats.round_costs and again.tokens == plain
    # streaming, with a stop string (ids written as digits): the text is cut before it
    digits = type("Digits", (), {"decode": staticmethod(lambda ids: "".join(map(str, ids)))})
    stop = "".join(map(str, plain[0][8:10]))
    stream = jaxmtp.generate_stream(model, prompts[0], max_new_tokens=20, speculative_k=2, stop=[stop],
                                    tokenizer=digits)
    pieces = list(stream)
    end = next(e for e in range(1, 21) if stop in "".join(map(str, plain[0][:e])))
    assert [t for p in pieces for t in p] == stream.output.tokens[0] == plain[0][:end]
    assert stream.text() == "".join(map(str, plain[0][:end])).split(stop)[0]
    with pytest.raises(InputError, match="speculative_k"):
        jaxmtp.generate(model, prompts, speculative_k=9)
    with pytest.raises(InputError, match="V3 family's compiled loop only"):  # V4's loop has no warm_up
        jaxmtp.generation.warm_up(model, prompts)


# One CSA layer with a small window and compression blocks, whose drafts are accepted about half
# the time: sampling's accept and residual paths both run (also tests/test_engine_v4.py).
SAMPLING = V4Config(vocab_size=8, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=1,
                    num_attention_heads=2, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,
                    layer_types=(CSA,), mlp_layer_types=("hash_moe",), head_dim=16, qk_rope_head_dim=4,
                    sliding_window=4, compress_rates=(2, 8), o_groups=2, o_lora_rank=8, index_n_heads=8,
                    index_head_dim=8, index_topk=1, hc_mult=2, initializer_range=0.15)
SAMPLING_PROMPT = [3, 1, 4, 1, 5]


def first_tokens_distribution(model, prompt: list[int], new: int) -> np.ndarray:
    """The model's distribution of its first `new` tokens after `prompt` at temperature 1 [V] * new,
    from whole forward passes over every continuation of new - 1 tokens."""
    import itertools

    vocab, n = model.config.vocab_size, len(prompt)
    heads = list(itertools.product(range(vocab), repeat=new - 1))
    logits, _ = model.forward(np.array([prompt + list(head) for head in heads]))
    probs = np.asarray(jax.nn.softmax(np.asarray(logits, np.float64), axis=-1))
    out = np.zeros((vocab,) * new)
    for row, head in enumerate(heads):
        p = np.prod([probs[row, n - 1 + j, t] for j, t in enumerate(head)])
        out[head] = p * probs[row, n + new - 2]
    return out


def test_speculative_sampling_at_k2_follows_the_model():
    """The first three tokens of 12,288 rows sampled with k = 2 against the model's distribution from
    whole forward passes over every continuation (chi-square); the rounds both accept and reject."""
    from test_speculative_sampling import chi_square_p_value

    vocab, prompt, samples = SAMPLING.vocab_size, SAMPLING_PROMPT, 12_288
    model = init_v4(SAMPLING, seed=4)
    out = generate(model, [prompt] * samples, 3, 2, temperature=1.0, seed=17)
    tokens, rounds = out.tokens, out.rounds
    counts = np.zeros((vocab,) * 3)
    np.add.at(counts, tuple(np.array(tokens).T), 1)
    expected = first_tokens_distribution(model, prompt, 3)
    p_value = chi_square_p_value(counts.ravel(), expected.ravel() * samples)
    assert p_value > 1e-3, p_value
    rate = rounds[0][1].mean() / 2
    assert 0.05 < rate < 0.95, rate


def test_info_counts_the_released_configs(capsys):
    from jaxmtp.cli import main

    main(["info", "--config", "deepseek_v4_flash"])
    flash = capsys.readouterr().out
    main(["info", "--config", "deepseek_v4_pro"])
    pro = capsys.readouterr().out
    assert "main model:                284.33 B" in flash and "active per token:           13.80 B" in flash
    assert "main model:                  1.57 T" in pro and "active per token:           49.78 B" in pro
    assert "21 CSA, 20 HCA, 2 sliding-window only" in flash
    # compressed entries grow by (512 + 128) / 4 values per CSA layer and 512 / 128 per HCA layer, in bf16
    assert f"{(21 * 640 // 4 + 20 * 4) * 2:,} B per token" in flash


def test_released_configs_load_and_count():
    flash = V4Config.from_hf_config(f"{CONFIGS}/deepseek_v4_flash.json")
    pro = V4Config.from_hf_config(f"{CONFIGS}/deepseek_v4_pro.json")
    assert (flash.layer_types.count(CSA), flash.layer_types.count(HCA), flash.layer_types.count(SLIDING)) == (21, 20, 2)
    assert (pro.layer_types.count(CSA), pro.layer_types.count(HCA), pro.layer_types[:2]) == (30, 31, (HCA, HCA))
    assert flash.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)
    assert flash.rope_scaling.factor == 16 and flash.expert_dtype == "fp4"
    assert transformers.DeepseekV4Config(**json.load(open(f"{CONFIGS}/deepseek_v4_pro.json"))).layer_types == list(
        pro.layer_types)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="deepseek_v41"), "deepseek_v41 is a different architecture"),
    (dict(compress_ratios=None), "layer_types: required"),
    (dict(compress_ratios=[0, 4, 7]), "compress_ratios: entries must be"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(o_groups=3), "o_groups"),
    (dict(scoring_func="sigmoid"), "scoring_func"),
])
def test_bad_configs_are_refused_by_name(change, message):
    raw = json.load(open(f"{CONFIGS}/deepseek_v4_flash.json"))
    raw.update(change)
    with pytest.raises(ConfigError, match=message):
        V4Config.from_hf_config(raw)


def test_v3_config_reader_points_v4_to_its_package():
    from jaxmtp.config import ModelConfig

    with pytest.raises(ConfigError, match="'deepseek_v4' is DeepSeek-V4, another architecture: jaxmtp.models.deepseek_v4"):
        ModelConfig.from_hf_config(f"{CONFIGS}/deepseek_v4_flash.json")


def test_unknown_tensor_names_are_refused():
    config = V4Config.from_hf_config(f"{CONFIGS}/deepseek_v4_flash.json")
    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.wq_c.weight"):
        params_from_hf(config, {"model.layers.0.self_attn.wq_c.weight": np.zeros(1)})
