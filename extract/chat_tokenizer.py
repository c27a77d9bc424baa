"""A tokenizer with its chat template, turning one conversation into samples with exact loss masks.

Engine-faithful ids. A serving engine (vLLM, SGLang, ``transformers serve``) answers an assistant turn
by rendering the chat template over the history with ``add_generation_prompt=True`` and the request's
template arguments, tokenizing that prompt, and generating. So for every trained assistant turn a
sample holds ``encode(prompt)`` followed by ``encode(generated)``, where *generated* is the part of
the turn's render after the prompt: reasoning, ``</think>``, answer, tool calls, up to and including
the end-of-turn token (``<|im_end|>``). The two are never tokenized as one string: with the
generation prompt ending in ``<think>\\n`` and an empty reasoning the model generated ``\\n``,
``</think>`` where one string would give ``\\n\\n``. The loss mask is 1 exactly on the generated
tokens. Special-token text *inside* a generated turn (a literal ``<|im_end|>`` in an answer) is
encoded as ordinary text, as the model must have produced it: the engine stops at the real token.
A turn the engine cut (``finish_reason: length``, an unclosed think block) gets no end-of-turn token
in its mask: the model never generated one.

Multi-turn. Qwen-style templates drop the reasoning of assistant turns before the last user message,
so earlier turns do not appear in later prompts as the target generated them. Turns are grouped into
one sample while the later prompt renders the earlier turns exactly as they were generated (as text,
and as tokens: the sample's ids before each turn equal ``encode`` of that turn's own prompt); a turn
that breaks this starts a sample of its own with everything before it as context. Every assistant
turn is masked exactly once, in the context it was generated in. With Qwen3/3.5 templates this means
one sample per user message answered (tool-call turns of one exchange share it); with a template that
keeps all reasoning (Qwen3.6 with ``preserve_thinking``) one sample per conversation. Ids:
``{id}#t{k}``, k the 0-based index among the conversation's assistant turns of the sample's last
turn; a conversation that gives one sample keeps its ``id``. ``expand=False`` keeps only the last.

Rows are normalised first (:mod:`.messages`); a row whose turns record the engine's ids is built from those
(:mod:`.engine_ids`); the ids and loss mask of both grow in one place (:class:`.sample.MaskedIds`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .engine_ids import engine_ids_of, engine_samples
from .messages import RowError, TemplateError, normalize_messages, not_generated_turns, template_kwargs_of
from .readers import ChatRecord
from .response import ResponseMarkers
from .sample import MaskedIds, TokenizedSample, annotate

if TYPE_CHECKING:
    import numpy as np

    from .tokenize_stats import TokenizeStats

# Control-token-like strings a template may emit; each must be one token of the tokenizer.
_MARKUP = re.compile(r"<\|[^<>|\s]+\|>|</?(?:think|tool_call|tool_response)>")


@dataclass(frozen=True)
class TurnRender:
    """One assistant turn as the engine met it: the prompt it answered and where its output ends.

    ``text`` is the render that includes the turn; ``text[:len(prompt)]`` is the prompt and
    ``text[len(prompt):end]`` what the model generated, up to and including the end-of-turn token.
    """

    prompt: str
    text: str
    end: int
    #: the message's own text (reasoning, answer) as rendered in ``generated``: special-token text inside
    #: these is ordinary text; markers outside them were inserted by the template
    own_text: tuple[str, ...] = ()

    @property
    def generated(self) -> str:
        return self.text[len(self.prompt) : self.end]


class ChatTokenizer:
    """A tokenizer plus what exact masking needs: its template, end-of-turn id and response markers.

    ``template_kwargs`` are passed to every render (``enable_thinking``, ``preserve_thinking``, ...);
    a row's own ``chat_template_kwargs`` override them. Assistant turns marked ``"generated": false`` are
    context, never in the loss, unless ``learn_not_generated`` (their samples are then flagged ``not_generated``).
    """

    def __init__(self, tokenizer, end_of_turn: str | None = None, markers: ResponseMarkers | None = None,
                 template_kwargs: dict | None = None, trust_engine_ids: bool = False,
                 learn_not_generated: bool = False):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {_name(tokenizer)} has no chat template")
        self.tokenizer = tokenizer
        self.markers = markers or ResponseMarkers.from_tokenizer(tokenizer, end_of_turn)
        self.template_kwargs = dict(template_kwargs or {})
        self.eot_text = tokenizer.convert_ids_to_tokens(self.markers.end_of_turn)
        self.trust_engine_ids = trust_engine_ids
        self.learn_not_generated = learn_not_generated
        self._marker_ids: dict[str, int | None] = {}
        self.vocab_size = len(tokenizer)
        self._check_control_tokens()

    def _check_control_tokens(self) -> None:
        """Fail early when the template emits markers the tokenizer would split into pieces."""
        probe = [
            {"role": "system", "content": "probe system"},
            {"role": "user", "content": "probe question"},
            {"role": "assistant", "content": "probe answer", "reasoning_content": "probe reasoning"},
        ]
        try:
            text = self.render(probe, kwargs=self.template_kwargs)
        except RowError as e:
            raise ValueError(f"tokenizer {_name(self.tokenizer)}: its chat template fails on a plain conversation: {e}")
        missing = sorted({tok for tok in _MARKUP.findall(text) if self._single(tok) is None})
        if missing:
            raise ValueError(
                f"tokenizer {_name(self.tokenizer)} lacks special token(s) {', '.join(missing)} used by its chat "
                "template (they would be split into several tokens)"
            )

    def _single(self, text: str) -> int | None:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[0] if len(ids) == 1 else None

    def render(self, messages: list[dict], tools=None, add_generation_prompt: bool = False,
               kwargs: dict | None = None, label: str = "") -> str:
        """The template's text; any failure inside the template is this row's ``template_error``."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **(kwargs or {})
            )
        except Exception as e:  # jinja raises TemplateError, TypeError (`|items` on a string), ...
            where = f"{label}: " if label else ""
            raise RowError("template_error", f"{where}chat template failed: {type(e).__name__}: {e}") from None

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of text as the engine tokenizes a rendered prompt (special-token text -> special ids)."""
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    def encode_generated(self, texts: list[str], own_text: list[tuple[str, ...]] | None = None) -> list[list[int]]:
        """Token ids of generated turns: the closing end-of-turn token, template-inserted markers (``</think>``,
        ``<tool_call>``, ...) as the one id the model emits for each, even where the tokenizer marks them
        special, and special-token text from the message's own text (``own_text``) as ordinary text: the model
        cannot have emitted the real token there (the engine stops at the end-of-turn one; a parser would have
        taken a marker out of the text)."""
        if not texts:
            return []
        own_text = own_text or [()] * len(texts)
        eot, n = self.markers.end_of_turn, len(self.eot_text)
        bodies = [t[:-n] if t.endswith(self.eot_text) else t for t in texts]
        # split each body at the markers the template put there; the pieces between are encoded with special
        # text split (added tokens split the text before the BPE either way, so no merge crosses a marker)
        pieces: list[str] = []
        layout: list[list[int | str]] = []  # per body: a marker's id, or a piece's index (as str)
        for body, own in zip(bodies, own_text, strict=True):
            spans = _own_spans(body, own)
            parts: list[int | str] = []
            start = 0
            for m in _MARKUP.finditer(body):
                marker = self._marker_id(m.group(0))
                if marker is None or any(a <= m.start() < b for a, b in spans):
                    continue
                if m.start() > start:
                    parts.append(str(len(pieces)))
                    pieces.append(body[start : m.start()])
                parts.append(marker)
                start = m.end()
            if start < len(body):
                parts.append(str(len(pieces)))
                pieces.append(body[start:])
            layout.append(parts)
        encoded = self.tokenizer(pieces, add_special_tokens=False, split_special_tokens=True)["input_ids"] if pieces else []
        out = []
        for parts, t in zip(layout, texts, strict=True):
            ids: list[int] = []
            for part in parts:
                ids += encoded[int(part)] if isinstance(part, str) else [part]
            out.append(ids + [eot] if t.endswith(self.eot_text) else ids)
        return out

    def _marker_id(self, text: str) -> int | None:
        if text not in self._marker_ids:
            self._marker_ids[text] = self._single(text)
        return self._marker_ids[text]

    def render_turn(self, messages: list[dict], t: int, tools, kwargs: dict, label: str) -> TurnRender:
        prompt = self.render(messages[:t], tools, add_generation_prompt=True, kwargs=kwargs, label=label)
        text = self.render(messages[: t + 1], tools, kwargs=kwargs, label=label)
        if not text.startswith(prompt):
            shown = json.dumps(kwargs, sort_keys=True) if kwargs else "none"
            raise TemplateError(
                "prompt_mismatch",
                f"{label}: assistant message {t} does not render as a continuation of its generation prompt "
                f"(template arguments: {shown}); e.g. data generated with thinking on/off rendered with the other "
                "setting: pass --chat-template-kwargs or the row's chat_template_kwargs",
            )
        close = text.rfind(self.eot_text, len(prompt))
        if close < 0:
            raise TemplateError(
                "no_end_of_turn",
                f"{label}: assistant message {t} renders without the end-of-turn token {self.eot_text!r}",
            )
        m = messages[t]
        own = tuple(x for x in (m.get("reasoning_content"), m.get("content")) if isinstance(x, str) and x.strip())
        return TurnRender(prompt, text, close + len(self.eot_text), own)

    def prompt_ids(self, messages: list[dict], t: int, tools, kwargs: dict, label: str) -> list[int]:
        """Turn ``t``'s generation prompt, rendered and encoded as an engine serving this template does."""
        prompt = self.render(messages[:t], tools, add_generation_prompt=True, kwargs=kwargs, label=label)
        return self.encode([prompt])[0]

    def text_ids(self, messages: list[dict], t: int, tools, kwargs: dict, label: str, cut: bool) -> list[int] | None:
        """What the text rule gives for turn ``t``'s generated ids (None when it cannot tokenize the turn; ``cut``:
        the engine cut the turn, so no end of turn)."""
        try:
            r = self.render_turn(messages, t, tools, kwargs, label)
        except RowError:
            return None
        ids = self.encode_generated([r.generated], [r.own_text])[0]
        return ids[:-1] if cut and ids and ids[-1] == self.markers.end_of_turn else ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def plan(self, messages: list[dict], tools, label: str, kwargs: dict | None = None
             ) -> tuple[list[list[int]], dict[int, TurnRender]]:
        """Groups of assistant turns that can share a sample, by text: a group ends at its last turn, and
        every turn in it renders inside that turn's render exactly as when it was generated. Sorted by end.
        """
        kwargs = self.template_kwargs if kwargs is None else kwargs
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        renders = {t: self.render_turn(messages, t, tools, kwargs, label) for t in turns}
        groups, pending = [], turns
        while pending:
            full = renders[pending[-1]].text
            stable = [t for t in pending if full.startswith(renders[t].text[: renders[t].end])]
            groups.append(stable)
            pending = [t for t in pending if t not in stable]
        return sorted(groups, key=lambda g: g[-1]), renders

    def build(self, group: list[int], renders: dict[int, TurnRender], cut: set[int], context: set[int] = frozenset()
              ) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
        """Samples of one text group: [(turns, ids, loss_mask)]; the turns in ``context`` are in the ids, never in
        the loss.

        Ids are ``encode(prompt of the first turn)``, then per turn ``encode(generated)`` and the encoded
        text up to the next turn's prompt. Before each later turn the ids so far must equal ``encode`` of
        that turn's own prompt (what the engine saw); where they do not (tokens merging across a turn
        boundary), that turn starts a new sample from its own prompt.
        """
        text = renders[group[-1]].text
        prompts = self.encode([renders[t].prompt for t in group])
        gens = self.encode_generated([renders[t].generated for t in group], [renders[t].own_text for t in group])
        # the text from the end of each turn to the next turn's generation prompt, all in one call
        gaps = [[]] + self.encode([text[renders[a].end : len(renders[b].prompt)] for a, b in zip(group, group[1:])])
        eot = self.markers.end_of_turn
        out = [MaskedIds()]
        for k, t in enumerate(group):
            if out[-1].turns and out[-1].ids + gaps[k] != prompts[k]:
                out.append(MaskedIds())  # the ids so far are not what the engine saw: a new sample
            gen = gens[k]
            learnt = 0 if t in context else len(gen) - (1 if t in cut and gen and gen[-1] == eot else 0)
            out[-1].add_turn(t, gaps[k] if out[-1].turns else prompts[k], gen, learnt)
        for s in out:
            if s.turns[-1] in cut and s.ids and s.ids[-1] == eot and not s.mask[-1]:
                s.ids, s.mask = s.ids[:-1], s.mask[:-1]  # the engine cut the turn: it never generated the end of turn
        return [s.arrays() for s in out]

    def tokenize(self, record: ChatRecord, expand: bool = True, stats: TokenizeStats | None = None
                 ) -> list[TokenizedSample]:
        """Samples of one conversation (see the module docstring); ``expand=False`` keeps only the last one.
        A row whose assistant turns carry the engine's ids is built from those (``engine_ids.engine_samples``);
        ``stats`` gets its engine counts.

        Raises :class:`RowError` (with its reason) when the row cannot be tokenized faithfully.
        """
        label = f"{record.where} (id={record.sample_id})" if record.where else f"id={record.sample_id}"
        messages, cut = normalize_messages(record.messages, label)
        kwargs = {**self.template_kwargs, **template_kwargs_of(record.template_kwargs, label)}
        engine = engine_ids_of(record.messages, self.vocab_size, label)
        flags: dict[int, list[str]] = {}
        # turns the target did not write: context (the engine rule learns only turns with ids anyway)
        hand = not_generated_turns(record.messages, label)
        context = set() if self.learn_not_generated else hand
        if engine:
            built, counts, flags = engine_samples(self, messages, engine, cut, record.tools, kwargs, label)
            if stats is not None:
                for k, v in counts.items():
                    setattr(stats, k, getattr(stats, k) + v)
        else:
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            messages = messages[: last + 1]  # trailing user/tool messages have no response to learn from
            groups, renders = self.plan(messages, record.tools, label, kwargs)
            built = [s for g in groups for s in self.build(g, renders, cut, context) if set(s[0]) - context]
            if not built:
                raise RowError("invalid_row", f"{label}: no assistant turn the target generated (each one is marked "
                                              "generated: false; --learn-not-generated learns them)")
            for t in hand - context:
                flags[t] = ["not_generated"]
        ordinal = {j: k for k, j in enumerate(i for i, m in enumerate(messages) if m["role"] == "assistant")}
        samples = []
        for turns, ids, mask in built if expand else built[-1:]:
            sample_id = record.sample_id if len(built) == 1 else f"{record.sample_id}#t{ordinal[turns[-1]]}"
            sample = TokenizedSample(sample_id, ids, mask, record.source)
            annotate(sample, self.markers)
            if cut.intersection(set(turns) - context):
                sample.add_flag("truncated")
            for t in turns:
                for f in flags.get(t, ()):
                    sample.add_flag(f)
            samples.append(sample)
        return samples


def _own_spans(body: str, own: tuple[str, ...]) -> list[tuple[int, int]]:
    """[start, end) of each of the message's own texts in the rendered turn, found in order (templates insert
    them verbatim, often stripped): special-token text inside them came from the content, not the template."""
    spans, cursor = [], 0
    for text in own:
        for candidate in (text, text.strip()):
            at = body.find(candidate, cursor) if candidate else -1
            if at >= 0:
                spans.append((at, at + len(candidate)))
                cursor = at + len(candidate)
                break
    return spans


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
