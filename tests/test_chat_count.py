"""Prompt-token counts without transformers (``longreel.engines.chat_count``): the same numbers as transformers'
``apply_chat_template``, for SmolLM2's tokenizer and for an offline-built one whose template uses more of jinja; the
cases it leaves to transformers are left to it; and the QRA counter no longer imports transformers."""
import json
import subprocess
import sys

import pytest

from longreel.engines import chat_count, local_models
from longreel.pipelines.qra.generate import TokenCounter

CHATS = [
    [{"role": "user", "content": "What happens first in the video?"}],
    [{"role": "system", "content": "You write questions."}, {"role": "user", "content": "Clip 1: a dog runs."}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "  leading and trailing spaces \n\n\t tabs\r\nCRLF  "}],
    [{"role": "user", "content": "Unicode: café, naïve, 東京の猫, emoji 🐕‍🦺 and ZWJ, Ελληνικά, עברית"}],
    [{"role": "user", "content": "A special token in a caption <|im_end|> and <|im_start|>assistant\nand <|endoftext|>"}],
    [{"role": "user", "content": "word " * 700}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
     {"role": "user", "content": "{{ not a template }} {% if %} </think> <answer>"}],
]


def transformers_count(tok, messages) -> int:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def smollm2_dir():
    local_models.load_tokenizer("smollm2")  # a fresh machine converts the GGUF tokenizer once, here
    return local_models.tokenizer_directory("smollm2")


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_smollm2_counts_equal_transformers(smollm2_dir, i):
    fast = chat_count.ChatTokenCounter.from_directory(smollm2_dir)
    assert fast is not None
    assert fast.count(CHATS[i]) == transformers_count(local_models.load_generic_tokenizer("smollm2"), CHATS[i])


TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(turns=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{% set ns.turns = ns.turns + 1 %}"
    "<|{{ message['role'] }}|>\n  {{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> turns={{ ns.turns }} {{ {'n': ns.turns} | tojson }}\n{% endif %}"
)


def build_generic_tokenizer(directory, template=TEMPLATE, **extra):
    """A byte-level BPE trained here, saved through transformers' generic fast tokenizer with ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<unk>", "<|assistant|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator([c["content"] for chat in CHATS for c in chat] * 3, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  **extra)
    tok.chat_template = template
    tok.save_pretrained(str(directory))
    return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)


def test_a_template_with_special_tokens_namespaces_and_loop_controls_counts_the_same(tmp_path):
    tok = build_generic_tokenizer(tmp_path)
    fast = chat_count.ChatTokenCounter.from_directory(str(tmp_path))
    assert fast is not None
    for chat in CHATS:
        assert fast.count(chat) == transformers_count(tok, chat), chat


def test_what_it_does_not_reproduce_is_left_to_transformers(tmp_path, smollm2_dir):
    # the special-token lists are passed differently: the whole directory goes to transformers
    build_generic_tokenizer(tmp_path / "lists", "{{ additional_special_tokens }}{{ messages[0]['content'] }}")
    assert chat_count.ChatTokenCounter.from_directory(str(tmp_path / "lists")) is None
    # a template jinja cannot compile without transformers' {% generation %} extension
    build_generic_tokenizer(tmp_path / "gen", "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}")
    assert chat_count.ChatTokenCounter.from_directory(str(tmp_path / "gen")) is None
    # a model-specific tokenizer class, which transformers rebuilds from the vocabulary
    build_generic_tokenizer(tmp_path / "cls")
    config = json.loads((tmp_path / "cls" / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (tmp_path / "cls" / "tokenizer_config.json").write_text(json.dumps(config))
    assert chat_count.ChatTokenCounter.from_directory(str(tmp_path / "cls")) is None
    # a special token the vocabulary lacks, which transformers would add
    build_generic_tokenizer(tmp_path / "add")
    config = json.loads((tmp_path / "add" / "tokenizer_config.json").read_text())
    config["pad_token"] = "<pad-not-in-vocab>"
    (tmp_path / "add" / "tokenizer_config.json").write_text(json.dumps(config))
    assert chat_count.ChatTokenCounter.from_directory(str(tmp_path / "add")) is None
    # messages with more than role and content strings
    fast = chat_count.ChatTokenCounter.from_directory(smollm2_dir)
    named = [{"role": "user", "content": "hi", "name": "x"}]
    assert fast.count(named) is None and fast.count([]) is None
    assert fast.count([{"role": "user", "content": ["hi"]}]) is None
    # ... which the QRA counter then counts with transformers, the same as before
    counter = TokenCounter("smollm2")
    assert counter(named) == transformers_count(local_models.load_generic_tokenizer("smollm2"), named)
    assert counter(CHATS[1]) == transformers_count(local_models.load_generic_tokenizer("smollm2"), CHATS[1])


def test_the_qra_counter_does_not_import_transformers(smollm2_dir):
    code = ("import sys\n"
            "from longreel.pipelines.qra.generate import TokenCounter\n"
            "n = TokenCounter('smollm2')([{'role': 'user', 'content': 'What happens first?'}])\n"
            "print(n, 'transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    n, imported = out.stdout.split()
    assert imported == "False"
    expected = transformers_count(local_models.load_generic_tokenizer("smollm2"),
                                  [{"role": "user", "content": "What happens first?"}])
    assert int(n) == expected
