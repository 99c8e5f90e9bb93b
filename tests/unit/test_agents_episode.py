"""Agent episodes and chat sessions: masks, versions, rewards, validation, and exact model tokens.

The chat-session checks use the locally trained char and BPE tokenizers of tests/helpers/models.py
(ChatML template) and give them model outputs whose ids a decode/re-encode would change.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from areal_async.agents import ChatSession, ChatTemplateError, Episode, Turn
from areal_async.agents.client import TOOL_RESULT_PREFIX, template_has_tool_role, template_renders_tools
from areal_async.engines.base import GenerationResult
from tests.helpers.models import build_tokenizer

EOS = 2  # <|im_end|> in the test tokenizers

# ChatML that refuses every role but system/user/assistant, as Llama-2 / Mistral templates do.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ChatML that drops reasoning from assistant turns followed by more messages, as Qwen3's does.
REASONING_TEMPLATE = (
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ChatML that lists the schemas passed as tools= in a system block, as Qwen2.5's does.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def char_tok() -> Any:
    return build_tokenizer("char")


@pytest.fixture(scope="module")
def bpe_tok() -> Any:
    return build_tokenizer("bpe")


def model_turn(ids: list[int], *, version: int = 0, reward: float = 0.0) -> Turn:
    return Turn(
        role="model",
        token_ids=tuple(ids),
        logprobs=(-0.5,) * len(ids),
        versions=(version,) * len(ids),
        reward=reward,
    )


def result_for(
    session: ChatSession, ids: list[int], *, version: int = 0, finish: str = "stop"
) -> GenerationResult:
    return GenerationResult(
        request_id="r",
        prompt_ids=tuple(session.token_ids),
        token_ids=list(ids),
        logprobs=[-0.25] * len(ids),
        versions=[version] * len(ids),
        finish_reason=finish,  # type: ignore[arg-type]
    )


def char_ids(tok: Any, text: str) -> list[int]:
    """One id per character, each encoded alone (not how the tokenizer would encode the text)."""
    return [tok.convert_tokens_to_ids(c) for c in text]


# --- episode bookkeeping ------------------------------------------------------------------------


def test_episode_masks_generated_tokens_only_and_marks_context_versions() -> None:
    """Model tokens get mask 1 and their versions; prompt, tool and user tokens mask 0, version -1, logprob 0."""
    episode = Episode(
        turns=(
            Turn(role="prompt", token_ids=(1, 2, 3)),
            model_turn([4, 5], version=3),
            Turn(role="tool", token_ids=(6,)),
            model_turn([7], version=3),
            Turn(role="user", token_ids=(8, 9)),
        )
    )
    assert episode.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert episode.loss_mask == [0, 0, 0, 1, 1, 0, 1, 0, 0]
    assert episode.versions == [-1, -1, -1, 3, 3, -1, 3, -1, -1]
    assert episode.logprobs == [0.0, 0.0, 0.0, -0.5, -0.5, 0.0, -0.5, 0.0, 0.0]
    assert episode.prompt_ids == [1, 2, 3]
    assert len(episode) == 9


def test_head_and_tail_version_span_a_weight_load_mid_episode() -> None:
    """Versions rise between turns and inside one; head is the oldest trained token, tail the newest."""
    loaded_mid_turn = Turn(role="model", token_ids=(7, 8, 9), logprobs=(-1.0,) * 3, versions=(5, 6, 6))
    episode = Episode(
        turns=(
            Turn(role="prompt", token_ids=(1,)),
            model_turn([2, 3], version=5),
            Turn(role="environment", token_ids=(4,)),
            loaded_mid_turn,
            Turn(role="environment", token_ids=(4,)),
            model_turn([10], version=7),
        )
    )
    assert (episode.head_version, episode.tail_version) == (5, 7)
    assert [v for v, m in zip(episode.versions, episode.loss_mask, strict=True) if m] == [5, 5, 5, 6, 6, 7]
    assert Episode(turns=(Turn(role="prompt", token_ids=(1,)),)).head_version == -1


def test_episode_reward_sums_or_discounts_the_model_turn_rewards() -> None:
    """gamma=1 sums the per-turn rewards; gamma<1 weighs the k-th model turn by gamma**k."""
    turns = (
        Turn(role="prompt", token_ids=(1,)),
        model_turn([2], reward=0.5),
        Turn(role="user", token_ids=(3,)),
        model_turn([4], reward=0.0),
        Turn(role="user", token_ids=(3,)),
        model_turn([5], reward=1.0),
    )
    assert Episode(turns=turns).turn_rewards == [0.5, 0.0, 1.0]
    assert Episode(turns=turns).reward == pytest.approx(1.5)
    assert Episode(turns=turns, gamma=0.5).reward == pytest.approx(0.5 + 0.25)


def test_episode_round_trips_through_a_plain_dict() -> None:
    """to_dict gives JSON-able plain values; from_dict rebuilds an equal, validated episode."""
    episode = Episode(
        turns=(Turn(role="prompt", token_ids=(1, 2), text="hi"), model_turn([3, 4], version=2, reward=1.0)),
        gamma=0.9,
        group_index=3,
        stop_reason="answer",
        info={"tool_calls": 2},
    )
    data = json.loads(json.dumps(episode.to_dict()))
    assert Episode.from_dict(data) == episode


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Turn(role="model", token_ids=(1, 2), logprobs=(-1.0,), versions=(0, 0)), "equal lengths"),
        (
            lambda: Turn(role="model", token_ids=(1,), logprobs=(-1.0,), versions=(-1,)),
            "versions of generated",
        ),
        (lambda: Turn(role="model", token_ids=(1,), logprobs=(float("nan"),), versions=(0,)), "finite"),
        (lambda: Turn(role="tool", token_ids=(1,), versions=(3,)), "context tokens have version -1"),
        (lambda: Turn(role="tool", token_ids=(1,), logprobs=(-2.0,)), "context tokens have logprob 0.0"),
        (lambda: Turn(role="user", token_ids=(1,), reward=1.0), "only model turns carry a reward"),
        (lambda: Turn(role="user", token_ids=()), "token_ids is empty"),
        (lambda: Turn(role="user", token_ids=(-4,)), "ints >= 0"),
        (lambda: Turn(role="robot", token_ids=(1,)), "turn role must be one of"),  # type: ignore[arg-type]
        (lambda: Episode(turns=(model_turn([1]),)), "first turn must be the 'prompt'"),
        (lambda: Episode(turns=(Turn(role="prompt", token_ids=(1,)),) * 2), "only the first turn"),
        (lambda: Episode(turns=(Turn(role="prompt", token_ids=(1,)),), gamma=0.0), "gamma must be in"),
        (lambda: Episode(turns=(Turn(role="prompt", token_ids=(1,)),), gamma=1.5), "gamma must be in"),
    ],
)
def test_invalid_turns_and_episodes_raise_naming_the_problem(make: Any, message: str) -> None:
    """Each inconsistency is a ValueError whose message says what is wrong."""
    with pytest.raises(ValueError, match=message):
        make()


def test_the_agents_package_imports_neither_torch_nor_the_bus() -> None:
    """Agent workers and their tests start without torch; the library stays below the bus."""
    code = "import sys, areal_async.agents; print(sorted({'torch', 'bus'} & {m.split('.')[0] for m in sys.modules}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- chat session -------------------------------------------------------------------------------


def test_session_keeps_model_ids_that_a_re_encode_would_merge(bpe_tok: Any) -> None:
    """BPE: ' quick' spelled one byte-token at a time stays so in the sequence and the episode."""
    session = ChatSession(bpe_tok, [{"role": "user", "content": "Say it."}])
    prompt = session.token_ids
    ids = char_ids(bpe_tok, "The") + char_ids(bpe_tok, "Ġquick") + [EOS]
    assert bpe_tok(bpe_tok.decode(ids[:-1]), add_special_tokens=False)["input_ids"] != ids[:-1]
    session.add_model_turn(result_for(session, ids))
    session.add_messages([{"role": "user", "content": "Again."}])
    assert session.token_ids[: len(prompt) + len(ids)] == prompt + ids
    assert session.episode().model_turns[0].token_ids == tuple(ids)
    assert session.messages[1] == {"role": "assistant", "content": "The quick"}


def test_session_keeps_special_token_text_the_model_spelled_out(char_tok: Any) -> None:
    """Char ids spelling '<|im_end|>' inside the answer are not turned into the special token."""
    session = ChatSession(char_tok, [{"role": "user", "content": "hi"}])
    ids = char_ids(char_tok, "a<|im_end|>b") + [EOS]
    session.add_model_turn(result_for(session, ids))
    turn = session.add_messages([{"role": "user", "content": "ok"}])
    assert session.turns[1].token_ids == tuple(ids)
    assert session.token_ids[-len(turn.token_ids) :] == list(turn.token_ids)
    assert turn.text == "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"


def test_session_sequence_equals_the_full_template_render_for_canonical_ids(char_tok: Any) -> None:
    """When the model's ids are the canonical encoding, the session equals rendering the whole chat."""
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    session = ChatSession(char_tok, opening)
    session.add_model_turn(result_for(session, char_tok("4", add_special_tokens=False)["input_ids"] + [EOS]))
    session.add_messages([{"role": "tool", "name": "calc", "content": "4"}])
    session.add_model_turn(
        result_for(session, char_tok("Yes, 4", add_special_tokens=False)["input_ids"] + [EOS])
    )
    session.add_messages([{"role": "user", "content": "Thanks"}])
    full = char_tok.apply_chat_template(session.messages, tokenize=False, add_generation_prompt=True)
    assert session.token_ids == char_tok(full, add_special_tokens=False)["input_ids"]
    assert [t.role for t in session.turns] == ["prompt", "model", "tool", "model", "user"]


def test_session_closes_a_turn_cut_by_max_new_tokens(char_tok: Any) -> None:
    """A turn without its end-of-turn token gets the template's whole closing in the next context turn."""
    session = ChatSession(char_tok, [{"role": "user", "content": "count"}])
    session.add_model_turn(result_for(session, char_ids(char_tok, "1 2 3"), finish="length"))
    turn = session.add_messages([{"role": "user", "content": "go on"}])
    assert turn.token_ids[:2] == (EOS, char_tok.convert_tokens_to_ids("\n"))
    assert session.episode().loss_mask.count(1) == 5


def test_session_falls_back_to_prefixed_user_messages_without_a_tool_role(char_tok: Any) -> None:
    """A template that refuses the tool role receives consecutive tool results as one user message."""
    strict = build_tokenizer("char")
    strict.chat_template = STRICT_TEMPLATE
    assert template_has_tool_role(char_tok) and not template_has_tool_role(strict)
    session = ChatSession(strict, [{"role": "user", "content": "q"}])
    session.add_model_turn(result_for(session, char_ids(strict, "call") + [EOS]))
    session.add_messages(
        [
            {"role": "tool", "name": "calculator", "content": "4"},
            {"role": "tool", "name": "python", "content": "5"},
        ]
    )
    first, second = TOOL_RESULT_PREFIX.format(name="calculator"), TOOL_RESULT_PREFIX.format(name="python")
    assert session.messages[-1] == {"role": "user", "content": f"{first}4\n\n{second}5"}
    assert session.turns[-1].role == "tool"


def test_session_extends_templates_that_rewrite_earlier_reasoning(char_tok: Any) -> None:
    """Dropping '<think>' text from earlier turns does not stop the session: the model's ids stay."""
    reasoning = build_tokenizer("char")
    reasoning.chat_template = REASONING_TEMPLATE
    session = ChatSession(reasoning, [{"role": "user", "content": "q"}])
    ids = char_ids(reasoning, "<think>hmm</think>42") + [EOS]
    session.add_model_turn(result_for(session, ids))
    turn = session.add_messages([{"role": "user", "content": "sure?"}])
    assert session.turns[1].token_ids == tuple(ids)
    assert turn.text == "\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n"


def test_session_puts_tools_in_the_system_prompt_unless_the_template_takes_them(char_tok: Any) -> None:
    """ChatML without tool support gets the tool list in a system message."""
    from areal_async.agents import Calculator

    assert not template_renders_tools(char_tok)
    session = ChatSession(char_tok, [{"role": "user", "content": "q"}], tools=[Calculator()])
    system = session.messages[0]
    assert system["role"] == "system" and '"name": "calculator"' in system["content"]
    assert "<tool_call>" in session.turns[0].text


def test_session_passes_tools_to_a_template_that_renders_them() -> None:
    """A Qwen2.5-style template gets the schemas through tools=, on every render; no system text is added."""
    from areal_async.agents import Calculator

    with_tools = build_tokenizer("char")
    with_tools.chat_template = TOOLS_TEMPLATE
    assert template_renders_tools(with_tools)
    session = ChatSession(with_tools, [{"role": "user", "content": "q"}], tools=[Calculator()])
    assert session.messages == [{"role": "user", "content": "q"}]
    assert session.turns[0].text.startswith('<|im_start|>system\n# Tools\n{"type": "function"')
    session.add_model_turn(result_for(session, char_ids(with_tools, "x") + [EOS]))
    turn = session.add_messages([{"role": "tool", "name": "calculator", "content": "4"}])
    assert turn.text == "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"


def test_session_refuses_what_would_break_the_token_record(char_tok: Any) -> None:
    """Wrong prompt, two model turns in a row, assistant messages, no template: clear errors."""
    session = ChatSession(char_tok, [{"role": "user", "content": "q"}])
    with pytest.raises(ValueError, match="add_messages follows a model turn"):
        session.add_messages([{"role": "user", "content": "x"}])
    stale = result_for(session, [5, EOS])
    session.add_model_turn(stale)
    with pytest.raises(ValueError, match="already a model turn"):
        session.add_model_turn(stale)
    with pytest.raises(ValueError, match="add_model_turn"):
        session.add_messages([{"role": "assistant", "content": "x"}])
    session.add_messages([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="completes a different prompt"):
        session.add_model_turn(stale)
    plain = build_tokenizer("char")
    plain.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatSession(plain, [{"role": "user", "content": "q"}])
