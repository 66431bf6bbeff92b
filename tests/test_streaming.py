"""Streaming, stop strings, log-probabilities, GenerationConfig, chat templates and the compile cache."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import generation_models as gm
import jaxmtp
from jaxmtp import GenerationConfig, generate_stream
from jaxmtp.errors import ConfigError

PROMPT = [3, 4, 5, 6]
NEW = 40


class Letters:
    """A tokenizer stand-in: token t decodes to one letter (t mod 7), so texts repeat often."""

    @staticmethod
    def decode(ids):
        return "".join("abcdefg"[t % 7] for t in ids)


def _streamed(model, prompt, **options):
    """(stream, its chunks); checks that the first chunk arrives before the loop has ended."""
    stream = generate_stream(model, prompt, **options)
    chunks = iter(stream)
    first = next(chunks)
    assert stream.output is None, "the first tokens came only after the loop ended"
    return stream, [first, *chunks]


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_stream_equals_generate_greedy(k):
    model = gm.model("partial")
    out = jaxmtp.generate(model, [PROMPT], max_new_tokens=NEW, speculative_k=k)
    stream, chunks = _streamed(model, PROMPT, max_new_tokens=NEW, speculative_k=k)
    assert chunks[0] == out.tokens[0][:1]  # the prefill's token, alone
    assert sum(chunks, []) == out.tokens[0]
    assert stream.output.tokens == out.tokens and stream.output.stats == out.stats


SAMPLED = dict(max_new_tokens=16, speculative_k=2, temperature=0.7, seed=1, return_logprobs=True)


def test_stream_equals_generate_sampled():
    model = gm.model("partial")
    out = jaxmtp.generate(model, [PROMPT], **SAMPLED)
    stream, chunks = _streamed(model, PROMPT, **SAMPLED)
    assert sum(chunks, []) == out.tokens[0] and stream.output.logprobs == out.logprobs
    assert out.tokens != jaxmtp.generate(model, [PROMPT], **{**SAMPLED, "seed": 2}).tokens  # it did sample


def test_leaving_a_stream_early_ends_it():
    model = gm.model("partial")
    stream = generate_stream(model, PROMPT, max_new_tokens=NEW, speculative_k=2)
    for chunk in stream:
        break
    assert chunk and stream.output is None
    assert jaxmtp.generate(model, [PROMPT], max_new_tokens=3).tokens[0] == jaxmtp.generate(
        model, [PROMPT], max_new_tokens=NEW).tokens[0][:3]


def test_stop_strings_end_at_the_token_that_completes_them():
    model = gm.model("partial")
    full = jaxmtp.generate(model, [PROMPT, [9, 10]], max_new_tokens=NEW).tokens
    stop = Letters.decode(full[0][12:15])  # text that really occurs, maybe earlier too
    expected = [row[:next((i + 1 for i in range(len(row)) if stop in Letters.decode(row[:i + 1])), len(row))]
                for row in full]
    out = jaxmtp.generate(model, [PROMPT, [9, 10]], max_new_tokens=NEW, speculative_k=2, stop=[stop],
                          tokenizer=Letters)
    assert out.tokens == expected and len(expected[0]) <= 15
    text = Letters.decode(expected[0])
    stream, shown = generate_stream(model, PROMPT, max_new_tokens=NEW, stop=[stop], tokenizer=Letters), []
    chunks = [chunk for chunk in stream if not shown.append(stream.text(final=False))]
    assert sum(chunks, []) == expected[0]
    assert stream.text() == text[:text.index(stop)]
    # text(final=False) while it streams: what can no longer change, so each is a start of the final
    # text (a stop string's first letters are held back until ruled out or completed)
    assert all(stream.text().startswith(part) for part in shown) and shown[-1] == stream.text()
    with pytest.raises(ValueError, match="tokenizer"):
        jaxmtp.generate(model, [PROMPT], stop=["a"])
    with pytest.raises(ValueError, match="tokenizer"):
        generate_stream(model, PROMPT).text()


def test_logprobs_are_the_main_models_and_agree_between_plain_and_speculative():
    """Each emitted token's log-probability equals log_softmax(logits / T) of a full forward pass
    over the prompt and the tokens before it (greedy: T = 1)."""
    model = gm.model("partial")

    def reference(tokens, temperature=1.0):
        logits, _ = model.forward(np.array([PROMPT + tokens]))
        logp = jax.nn.log_softmax(np.asarray(logits[0], np.float64) / temperature, axis=-1)
        return [float(logp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(tokens)]

    plain = jaxmtp.generate(model, [PROMPT], max_new_tokens=16, return_logprobs=True)
    spec = jaxmtp.generate(model, [PROMPT], max_new_tokens=16, speculative_k=2, return_logprobs=True)
    assert spec.tokens == plain.tokens and spec.stats.accepted_tokens > 0
    np.testing.assert_allclose(plain.logprobs[0], reference(plain.tokens[0]), atol=1e-4)
    np.testing.assert_allclose(spec.logprobs[0], plain.logprobs[0], atol=1e-5)
    sampled = jaxmtp.generate(model, [PROMPT], **SAMPLED)
    np.testing.assert_allclose(sampled.logprobs[0], reference(sampled.tokens[0], SAMPLED["temperature"]), atol=1e-4)
    assert jaxmtp.generate(model, [PROMPT], max_new_tokens=4).logprobs is None


def test_generation_config_and_keywords_are_one_api(tmp_path):
    model = gm.model("partial")
    config = GenerationConfig(max_new_tokens=6, speculative_k=2, eos_token_id=[1, 2])
    assert jaxmtp.generate(model, [PROMPT], config).tokens == jaxmtp.generate(
        model, [PROMPT], max_new_tokens=6, speculative_k=2, eos_token_id=[1, 2]).tokens
    assert len(jaxmtp.generate(model, [PROMPT], config, max_new_tokens=3, eos_token_id=None).tokens[0]) == 3
    with pytest.raises(TypeError, match="unknown generation option max_tokens"):
        jaxmtp.generate(model, [PROMPT], max_tokens=3)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "eos_token_id": [1, 2], "bos_token_id": 0}))
    read = GenerationConfig.from_pretrained(str(tmp_path), top_p=0.9)
    assert (read.temperature, read.top_p, read.eos_token_id) == (0.6, 0.9, [1, 2])
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))  # no do_sample: greedy
    assert GenerationConfig.from_pretrained(str(tmp_path)).temperature == 0.0
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": "yes"}))
    with pytest.raises(ConfigError, match="generation_config.json: do_sample"):
        GenerationConfig.from_pretrained(str(tmp_path))


def test_generation_stats_counts_and_ratios():
    # 10 tokens: the prefill's, then 3 rounds of 2 accepted drafts and 1 more
    stats = jaxmtp.generate(gm.model("always"), [PROMPT, [7]], max_new_tokens=10, speculative_k=2).stats
    assert stats.rounds == (3, 3) and stats.drafted == (6, 6) and stats.accepted == (6, 6) and stats.steps == 4
    assert stats.acceptance_rate == 1.0 and stats.mean_accepted_length == 3.0
    assert stats.rounds_by_k == {2: 6} and stats.per_row[1].rounds_by_k == {2: 3}
    assert json.loads(json.dumps(stats.as_dict()))["per_row"][0]["mean_accepted_length"] == 3.0


def test_cli_chat_template_generation_config_and_stop(tmp_path, capsys):
    """--chat writes the prompt with the checkpoint's template; max_new_tokens comes from its
    generation_config.json; --stop ends the text before the stop string."""
    from jaxmtp.chat import chat_prompt
    from jaxmtp.cli import main

    model = gm.model("partial")
    directory = tmp_path / "m"
    jaxmtp.save(model, directory, format="hf")
    tokenizer = gm.byte_tokenizer(directory / "tokenizer.json")
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template,
                                                                 "bos_token": {"content": "<s>"}}))
    (directory / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5}))
    assert chat_prompt(str(directory), "fib?") == "<s><|user|>fib?\n<|assistant|>"
    main(["generate", "fib?", "--chat", "--model", str(directory), "--k", "1", "--ignore-eos", "--quiet"])
    printed = capsys.readouterr().out
    ids = tokenizer.encode("<s><|user|>fib?\n<|assistant|>", add_special_tokens=False).ids
    tokens = jaxmtp.generate(model, [ids], max_new_tokens=5).tokens[0]
    assert printed.startswith(tokenizer.decode(ids) + tokenizer.decode(tokens) + "\n\n")
    assert "5 new tokens" in printed
    stop = tokenizer.decode(tokens[2:4])
    main(["generate", "fib?", "--chat", "--model", str(directory), "--k", "0", "--ignore-eos", "--quiet",
          "--stop", stop.replace("\n", "\\n")])
    text = tokenizer.decode(tokens)
    assert capsys.readouterr().out.startswith(tokenizer.decode(ids) + text[:text.index(stop)] + "\n\n")


_CACHED_RUN = """
import json, logging, sys
import jaxmtp
from jaxmtp import compile_cache
# Every program stored, however fast it compiles: under the suite's flags this model's jit_start
# compiles in about 0.2 s, at the threshold, so that a fast machine did not store it.
compile_cache.MIN_COMPILE_SECONDS = 0.0
logging.basicConfig(level=logging.WARNING)
logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
config = jaxmtp.ModelConfig.from_hf_config(sys.argv[1]).replace(num_hidden_layers=2, num_nextn_predict_layers=0)
model = jaxmtp.init(config)
print(json.dumps(jaxmtp.generate(model, [[5, 6, 7]], max_new_tokens=6).tokens))
"""


def test_compiled_loops_are_reused_from_the_cache_by_a_second_process_only_with_the_same_flags(tmp_path):
    flags = os.environ["XLA_FLAGS"]  # the test run's (tests/conftest.py)
    env = {**os.environ, "JAXMTP_COMPILE_CACHE": str(tmp_path / "xla")}

    def run(flags=flags):
        done = subprocess.run([sys.executable, "-c", _CACHED_RUN, os.path.join(jaxmtp.CONFIGS, "tiny.json")],
                              env={**env, "XLA_FLAGS": flags}, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        hits = {line.split("'")[1] for line in done.stderr.splitlines() if "Persistent compilation cache hit" in line}
        return json.loads(done.stdout), hits

    cold, cold_hits = run()
    stored = set(os.listdir(tmp_path / "xla"))
    assert any(name.startswith("jit_advance") for name in stored) and not cold_hits
    warm, warm_hits = run()
    assert warm == cold and {"jit_start", "jit_advance"} <= warm_hits
    other, other_hits = run(flags + " --xla_force_host_platform_device_count=2")  # other flags: compiled anew
    assert other == cold and not other_hits
