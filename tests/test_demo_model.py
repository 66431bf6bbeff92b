"""The bundled demo model: a loadable checkpoint within the size budget whose MTP layer really drafts."""

import json
import os

import jaxmtp
from jaxmtp import data
from tokenizers import Tokenizer


def _tokenizer():
    return Tokenizer.from_file(os.path.join(jaxmtp.DEMO_MODEL, "tokenizer.json"))


def test_demo_model_is_a_small_hf_checkpoint_with_a_record():
    files = os.listdir(jaxmtp.DEMO_MODEL)
    assert {"config.json", "tokenizer.json", "training.json", "README.md"} <= set(files)
    size = sum(os.path.getsize(os.path.join(jaxmtp.DEMO_MODEL, f)) for f in files)
    assert size <= 15 * 2**20, size
    record = json.load(open(os.path.join(jaxmtp.DEMO_MODEL, "training.json")))
    assert record["train_config"]["seed"] == 0 and record["final_losses"]["mtp_loss"] > 0
    model = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    assert model.config.has_mtp and model.config.num_moe_layers > 0 and model.config.n_group > 1
    assert model.config.vocab_size == _tokenizer().get_vocab_size()


def test_demo_model_drafts_are_accepted_on_held_out_code():
    """Greedy, batch 1, held-out standard-library prompts: k=1 acceptance >= 0.70, and the
    speculative tokens equal plain greedy decoding."""
    model = jaxmtp.load(jaxmtp.DEMO_MODEL, quiet=True)
    drafted = accepted = 0
    for prompt in data.held_out_prompts(_tokenizer(), count=4, length=32):
        plain = jaxmtp.generate(model, [prompt], max_new_tokens=48)
        spec = jaxmtp.generate(model, [prompt], max_new_tokens=48, speculative_k=1)
        assert spec.tokens == plain.tokens
        drafted += spec.stats.draft_tokens
        accepted += spec.stats.accepted_tokens
    assert accepted / drafted >= 0.70, accepted / drafted
