"""The tiny checkpoints' tokenizer: a 1024-token byte-level BPE trained (deterministically, no
downloads) on an embedded corpus, with five special tokens and a chat template
(model_loader/tiny_models.py builds the checkpoints around it)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
# Order fixes the ids: bos=0, eos=pad=1 (also the HF config defaults), roles 2..4.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = 0, 1, 1
TOKENIZER_VOCAB_SIZE = 1024

# The template adds bos itself; plain ``encode()`` never adds special tokens
# (add_bos_token=False), so ``apply_chat_template(tokenize=True)`` and
# ``encode(apply_chat_template(tokenize=False), add_special_tokens=...)`` agree.
# Each turn ends with eos so that generation stops at eos. Tools are listed in a system turn, tool
# results are a `tool` turn and an assistant's tool calls follow its content (a made-up format:
# tests force real models' formats through scripted outputs).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|system|>\\n# Tools\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- eos_token + '\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('Unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set args = call['function']['arguments'] -%}"
    "{{- '<tool_call>' + call['function']['name'] + ' ' + (args | tojson if args is mapping else args) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- eos_token + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

# Training corpus: varied English prose, GSM8K-style word problems, code, digits,
# punctuation. Embedded (no downloads) and generated without randomness.
_PROSE = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. Every morning
he rowed his boat out past the rocks, cast his nets, and waited patiently for the tide to turn.
Machine learning models are trained on large datasets. Language models predict the next token given the
previous tokens. Attention lets every position look at every other position, but sparse attention selects
only the most relevant positions, which makes very long contexts affordable.
The weather today is sunny with a high of 75 degrees and a low of 58 degrees. Tomorrow there is a chance
of rain in the afternoon, so remember to bring an umbrella if you are going outside.
Please read the instructions carefully before you begin. Write your name at the top of the page, answer
every question, and check your work when you are finished. You have forty-five minutes.
She opened the window and looked at the garden: roses, tulips, daisies and sunflowers were blooming after
the long winter. Birds were singing in the trees, and the air smelled of fresh grass and warm bread.
History shows that great cities grow near rivers, harbors and trade routes. Paris, London, New York, Tokyo,
Cairo and Rome all became centers of culture, science, art, music and commerce.
What time is it? It is half past seven. Where are you going? I am going to the library to return a book.
Why did the chicken cross the road? To get to the other side! How many apples are left? There are three.
The server received the request, checked the cache, scheduled the batch, ran the forward pass, sampled a
token, and streamed the response back to the client. Latency, throughput and memory usage were measured.
Dear customer, thank you for your order. Your package will arrive within 3-5 business days. If you have any
questions, please contact our support team at support@example.com or call (555) 123-4567.
In mathematics, a prime number is a natural number greater than 1 that has no positive divisors other than
1 and itself. The first primes are 2, 3, 5, 7, 11, 13, 17, 19, 23 and 29. Pi is approximately 3.14159.
Water boils at 100 degrees Celsius and freezes at 0 degrees. The Earth orbits the Sun once every 365.25 days,
and the Moon orbits the Earth roughly every 27 days. Light travels about 300,000 kilometers per second.
"Hello," said the teacher. "Good morning," replied the students. 'Let's start,' she said; everyone agreed.
Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, se\u00f1or, \u00fcber, Stra\u00dfe, \u00e5ngstr\u00f6m \u2014 and \u201cquotes\u201d \u2026 \u00a9 2024, 50\u20ac, \u00a310, \u00a5100.
"""

_GSM8K = """\
Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?
Answer: In May she sold 48 / 2 = 24 clips. Altogether she sold 48 + 24 = 72 clips. The answer is 72
Question: Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?
Answer: Weng earns 12 / 60 = $0.2 per minute. Working 50 minutes, she earned 0.2 x 50 = $10. The answer is 10
Question: Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How much more money does Betty need to buy the wallet?
Answer: Betty has 100 / 2 = $50. Her grandparents gave her 15 * 2 = $30. She needs 100 - 50 - 30 - 15 = $5 more. The answer is 5
Question: James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?
Answer: He writes each friend 3 * 2 = 6 pages a week. So he writes 6 * 2 = 12 pages every week. That means he writes 12 * 52 = 624 pages a year. The answer is 624
Question: A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?
Answer: It takes 2 / 2 = 1 bolt of white fiber. So the total is 2 + 1 = 3 bolts. The answer is 3
Question: Tom has 7 boxes with 6 pencils in each box. He gives away 15 pencils. How many pencils does he have left?
Answer: Tom has 7 * 6 = 42 pencils. After giving away 15 he has 42 - 15 = 27 pencils. The answer is 27
Question: A train travels 60 miles per hour for 3 hours and then 45 miles per hour for 2 hours. How far does it travel?
Answer: First it travels 60 * 3 = 180 miles. Then it travels 45 * 2 = 90 miles. In total 180 + 90 = 270 miles. The answer is 270
Question: What is 6 times 7?
Answer: 6 * 7 = 42. The answer is 42
"""

_CODE = """\
def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key, value=1):
        self.counts[key] = self.counts.get(key, 0) + value
        return self.counts[key]


if __name__ == "__main__":
    import json
    data = {"name": "tiny", "layers": [1, 2, 3], "ok": True, "ratio": 0.5}
    print(json.dumps(data, indent=2))
    for i in range(10):
        if i % 2 == 0 and i != 4:
            print(f"even: {i}")
        else:
            print("odd:", i)

#include <stdio.h>
int main(int argc, char **argv) {
    int total = 0;
    for (int i = 0; i < argc; ++i) { total += i * 2; }
    printf("total = %d\\n", total);
    return 0;
}

SELECT id, name, price FROM products WHERE price > 10.5 ORDER BY price DESC LIMIT 20;
const add = (x, y) => x + y; let items = [1, 2, 3].map((v) => v * 2); console.log(items);
$ pip install -e . && pytest -q tests/ --maxfail=1 # run the tests
<html><body><div class="main"><p>Hello &amp; welcome!</p></div></body></html>
"""


def _training_corpus() -> list[str]:
    lines = (_PROSE + _GSM8K + _CODE).splitlines()
    # Deterministic arithmetic drills so that numbers and operators get merges.
    for a in range(2, 30):
        b = (a * 7) % 13 + 1
        lines.append(f"{a} + {b} = {a + b}, {a} - {b} = {a - b}, {a} * {b} = {a * b}, {a * b} / {b} = {a}.")
    punct = "!?.,;:()[]{}<>+-*/=%&|^~@#$_'\"`\\"
    lines.append(" ".join(punct) + " " + punct)
    lines.append("0123456789 " * 4)
    return [line + "\n" for line in lines]


def _train_tokenizer_object() -> "Any":
    """Train the byte-level BPE (``tokenizers.Tokenizer``); deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # No normalizer + byte-level pre-tokenizer/decoder: every UTF-8 string round-trips.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    if tok.get_vocab_size() != TOKENIZER_VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected "
            f"{TOKENIZER_VOCAB_SIZE}: the embedded corpus is too small"
        )
    return tok


def build_tokenizer(out_dir: str) -> "PreTrainedTokenizerFast":
    """Build the tiny tokenizer, ``save_pretrained`` it into ``out_dir`` and return it.

    bos is NOT prepended by ``encode`` (no post-processor template); the chat
    template emits it explicitly.
    """
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer_object(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        extra_special_tokens=[SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return tokenizer
