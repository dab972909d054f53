"""Usage of a request's choices (entrypoints/openai/protocol.py `usage_of`): with n > 1 each
distinct prompt, and its cached tokens, is billed once. CPU, no server."""

from __future__ import annotations

from sglang.srt.entrypoints.openai.protocol import usage_of


def result(prompt_index: int, prompt: int, completion: int, cached: int) -> dict:
    return {"meta_info": {"prompt_index": prompt_index, "prompt_tokens": prompt, "completion_tokens": completion,
                          "cached_tokens": cached}}


def test_n_choices_bill_prompt_and_cache_once():
    # n = 3 of one 57-token prompt whose 56 leading tokens were cached for every choice
    u = usage_of([result(0, 57, 4, 56), result(0, 57, 5, 56), result(0, 57, 6, 56)])
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (57, 15, 72)
    assert u.prompt_tokens_details == {"cached_tokens": 56}


def test_the_first_choice_of_each_prompt_counts():
    # two prompts x n = 2; the second choice of a prompt may see more of it cached (the first
    # one's KV): the first choice, which the prompt tokens come from, is the one counted
    u = usage_of([result(0, 10, 1, 0), result(0, 10, 1, 9), result(1, 20, 2, 16), result(1, 20, 2, 19)])
    assert (u.prompt_tokens, u.completion_tokens) == (30, 6)
    assert u.prompt_tokens_details["cached_tokens"] == 16
    assert u.prompt_tokens_details["cached_tokens"] <= u.prompt_tokens


def test_results_without_a_prompt_index_count_each():
    u = usage_of([{"meta_info": {"prompt_tokens": 5, "completion_tokens": 1, "cached_tokens": 2}}] * 1
                 + [{"meta_info": {"prompt_tokens": 7, "completion_tokens": 1}}])
    assert u.prompt_tokens == 12 and u.prompt_tokens_details["cached_tokens"] == 2
