"""jaxmtp against HF transformers' DeepseekV3ForCausalLM and its generic MtpLayer (PyTorch, float32)."""

import numpy as np
import pytest
import torch

import hf_reference as ref
from long_tests import skip_unless_long
import jaxmtp

BATCH, LENGTH = 2, 32


@pytest.fixture(scope="module", params=sorted(ref.CONFIGS))
def pair(request, tmp_path_factory):
    """(HF main, HF MTP, jaxmtp model loaded from the saved checkpoint, token ids [B, T+1], name)."""
    main, mtp = ref.build(request.param, seed=len(request.param))
    directory = ref.save(main, mtp, str(tmp_path_factory.mktemp(request.param)))
    ids = torch.randint(0, main.config.vocab_size, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(7))
    return main, mtp, jaxmtp.load(directory), ids, request.param


def test_logits_and_hidden_match_transformers(pair):
    main, _, model, ids, _ = pair
    with torch.no_grad():
        expected_logits = main(ids[:, :LENGTH]).logits.numpy()
        expected_hidden = main.model(ids[:, :LENGTH]).last_hidden_state.numpy()
    logits, hidden = model.forward(ids[:, :LENGTH].numpy())
    assert logits.shape == (BATCH, LENGTH, main.config.vocab_size) and logits.dtype == np.float32
    np.testing.assert_allclose(np.asarray(logits), expected_logits, rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(hidden), expected_hidden, rtol=0, atol=1e-4)


def test_mtp_matches_transformers_mtp_layer(pair):
    main, mtp, model, ids, _ = pair
    with torch.no_grad():
        hidden = main.model(ids[:, :LENGTH]).last_hidden_state
        expected = ref.mtp_logits(mtp, hidden, ids[:, 1:]).numpy()
    logits = model.mtp_forward(hidden.numpy(), ids[:, 1:].numpy())
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=0, atol=1e-4)


def test_decode_layout_matches_transformers(pair):
    """The layout generation decodes in (unrolled, split experts, [in, out] weights, joint
    projections) is the same model."""
    main, mtp, model, ids, _ = pair
    decoding = model.decoding()
    assert decoding.layout.unrolled and decoding.layout.inputs_first and decoding.layout.joint_projections
    with torch.no_grad():
        expected_logits = main(ids[:, :LENGTH]).logits.numpy()
        hidden = main.model(ids[:, :LENGTH]).last_hidden_state
        expected_mtp = ref.mtp_logits(mtp, hidden, ids[:, 1:]).numpy()
    np.testing.assert_allclose(np.asarray(decoding.forward(ids[:, :LENGTH].numpy())[0]), expected_logits, rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(decoding.mtp_forward(hidden.numpy(), ids[:, 1:].numpy())), expected_mtp,
                               rtol=0, atol=1e-4)


def test_loaded_parameters_equal_checkpoint(pair):
    """Spot-check the name mapping: stacked layer and expert slices hold the HF tensors."""
    main, _, model, _, _ = pair
    cfg = model.config
    hf_layer = main.model.layers[cfg.num_hidden_layers - 1]
    stack = model.params["moe_layers"]["layers"] if cfg.num_moe_layers else model.params["dense_layers"]["layers"]
    np.testing.assert_array_equal(np.asarray(stack["self_attn"]["kv_b_proj"]["weight"][-1]),
                                  hf_layer.self_attn.kv_b_proj.weight.detach().numpy())
    if cfg.num_moe_layers:
        gate_up = hf_layer.mlp.experts.gate_up_proj.detach().numpy()
        np.testing.assert_array_equal(np.asarray(stack["mlp"]["experts"]["up_proj"][-1, 5]),
                                      gate_up[5, cfg.moe_intermediate_size:])


def naive_greedy(model, prompt, new_tokens, width):
    """A full forward over the sequence so far (right-padded to `width`: a causal model's logits at
    a position ignore what follows it), argmax at its last token, append; new_tokens times."""
    sequence = list(prompt)
    for _ in range(new_tokens):
        logits, _ = model.forward(np.asarray([sequence + [0] * (width - len(sequence))]))
        sequence.append(int(np.argmax(np.asarray(logits)[0, len(sequence) - 1])))
    return sequence[len(prompt):]


def test_greedy_generate_is_a_naive_loop_and_transformers_generate(pair):
    """A ragged batch, plain and speculative (each config one k of 1..4): token for token what a
    naive loop over full forward passes gives, and what HF's own greedy `generate` gives."""
    main, _, model, _, name = pair
    if name in ("no_q_lora", "yarn_groups"):
        skip_unless_long("the other configs' generation covers the loop, and their logits HF parity")
    k = 1 + sorted(ref.CONFIGS).index(name)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, main.config.vocab_size, n).tolist() for n in (5, 11)]
    new = 8
    naive = [naive_greedy(model, p, new, 11 + new) for p in prompts]
    with torch.no_grad():
        hf = [main.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert naive == hf
    for speculative_k in (0, k):
        got = jaxmtp.generate(model, prompts, max_new_tokens=new, speculative_k=speculative_k, eos_token_id=None)
        assert got.tokens == naive, speculative_k
