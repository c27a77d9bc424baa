"""Which engines, trainers and exports serve a store's taps: one table, taken from their own code.

A tap id ``l`` is always the output of decoder layer ``l`` (0-based) before the final norm, the last layer's
(``N - 1``) too. Hugging Face's ``hidden_states[l + 1]`` is that tensor for every layer but the last: transformers
replaces its last entry by the final norm's output (``final_hidden`` here). The engines differ exactly there, which
makes a drafter trained on tap ``N - 1`` one tensor in training and another, or nothing, at serving:

========================  ==========================================================================================
sglang (engine)           captures the residual entering layer ``l + 1`` (``layers_to_capture = [l + 1 ...]``), so
                          tap ``N - 1`` has no capture point: Qwen3.5's hook indexes ``layers[N]`` and fails, and
                          SpecForge's own capture (SGLang) cannot make it either. Read: sglang ``srt/models/
                          qwen3_5.py`` at 005fa711 (``set_dflash_layers_to_capture``), ``speculative/dflash_utils.py``
                          at 7f151c5e.
vllm (engine)             re-bases DFlash ``target_layer_ids`` by one (its aux id ``l + 1`` = ``hidden + residual``
                          after layer ``l``; id ``N`` = the last layer before the norm): every tap, as trained.
                          Read: vllm ``model_executor/models/qwen3_dflash.py`` at d952bda8; speculators' converter.
dflash (engine)           z-lab's reference ``dflash_generate`` reads ``output.hidden_states[l + 1]``: for
                          ``N - 1`` the final norm's output, not what was trained. Read: z-lab/dflash
                          ``dflash/model.py`` at 44947fbf (``extract_context_feature``).
train (trainer)           hsstore's own: every tap of the store is a drafter tap.
specforge-dflash          SpecForge's offline DFlash reader (``hidden_states`` [1, T, L*H], ``target_layer_ids`` =
                          hsstore ids): every tap. Read: SpecForge a6b6b023.
specforge-eagle3          SpecForge's EAGLE-3 model takes exactly 3 aux taps (default ``[1, N//2 - 1, N - 4]``) and
                          the final norm's output (``hidden_state``): needs ``final_hidden``. Read: SpecForge
                          a6b6b023 ``algorithms/model_providers.py`` (``resolve_eagle_capture_layers``).
speculators               its trainer splits the last slot off as ``verifier_last_hidden_states`` (vLLM id ``N``,
                          the last layer before the norm) and trains the drafter on the others: needs tap ``N - 1``.
                          Read: speculators c05b95b3 ``train/data.py``, ``convert/dflash/converter.py``.
========================  ==========================================================================================

Extraction, ``check``, ``train``, ``export-drafter``, ``export`` and ``info`` ask this module; nothing else
states these facts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from .taps import check_taps, default_taps

TAP_TENSOR = "output of decoder layer l (0-based), before the final norm"  # the one meaning of tap id l


def tensor_of(layer: int, num_layers: int) -> str:
    """The tensor tap ``layer`` of a ``num_layers`` target holds, as a person reads it."""
    if layer == num_layers - 1:
        return f"the last layer's output before the final norm; HF's hidden_states[{num_layers}] is the norm's output"
    return f"output of decoder layer {layer}, before the final norm (HF hidden_states[{layer + 1}])"


def tap_tensor(layer: int, num_layers: int) -> str:
    return f"layer {layer}: {tensor_of(layer, num_layers)}"


def specforge_eagle3_ids(num_layers: int) -> list[int]:
    """SpecForge's default EAGLE-3 capture layers ``[1, N//2 - 1, N - 4]`` (its own ids = hsstore ids)."""
    n = num_layers
    return [1, n // 2 - 1, n - 4]


@dataclass(frozen=True)
class Consumer:
    """One engine (serves a drafter trained on a store's taps) or trainer/export (reads the store's features).

    ``refuses(l, N)``: why this consumer cannot use tap ``l`` of an ``N``-layer target, or None. ``needs(N)``: the
    layers it must find in the store beside the drafter's. ``features``: store features it needs."""

    name: str
    kind: str  # "engine" or "trainer"
    what: str  # one line: what it reads
    refuses: Callable[[int, int], str | None] = lambda l, n: None
    needs: Callable[[int], list[int]] = lambda n: []
    features: tuple[str, ...] = ()
    min_taps: int = 1


def _sglang_refuses(l: int, n: int) -> str | None:
    if l + 1 >= n:
        return f"SGLang captures the input of layer {l + 1}, and there is none"
    return None


def _dflash_refuses(l: int, n: int) -> str | None:
    if l == n - 1:
        return f"z-lab dflash feeds HF hidden_states[{n}], the final norm's output, not the tensor trained on"
    return None


CONSUMERS: dict[str, Consumer] = {c.name: c for c in (
    Consumer("train", "trainer", "hsstore train: every tap is a drafter tap"),
    Consumer("specforge-dflash", "trainer", "export specforge, DFlash layout (hidden_states [1, T, L*H])"),
    Consumer("specforge-eagle3", "trainer", "export specforge, EAGLE-3 layout: 3 aux taps + final_hidden",
             needs=specforge_eagle3_ids, features=("final_hidden",), min_taps=3),
    Consumer("speculators", "trainer", "export speculators: its trainer needs the last layer before the norm",
             needs=lambda n: [n - 1]),
    Consumer("sglang", "engine", "SGLang serving (captures at l+1)", refuses=_sglang_refuses),
    Consumer("vllm", "engine", "vLLM serving (aux id l+1, the last layer before the norm included)"),
    Consumer("dflash", "engine", "z-lab dflash (HF hidden_states[l+1])", refuses=_dflash_refuses),
)}
ENGINES = tuple(n for n, c in CONSUMERS.items() if c.kind == "engine")


def names() -> list[str]:
    return list(CONSUMERS)


def parse_serve(text: str | Sequence[str] | None) -> list[str]:
    """``--serve sglang,speculators`` as known consumer names; an unknown one is refused with the list."""
    if not text:
        return []
    items = text.split(",") if isinstance(text, str) else list(text)
    out = [x.strip().lower() for x in items if x.strip()]
    bad = [x for x in out if x not in CONSUMERS]
    if bad:
        raise ValueError(f"--serve {','.join(out)}: unknown {', '.join(map(repr, bad))} (choose from "
                         f"{', '.join(CONSUMERS)})")
    return list(dict.fromkeys(out))


@dataclass
class Serving:
    """A tap list against every consumer: who serves it and, for each who does not, one reason naming the tap."""

    layers: list[int]
    num_layers: int
    features: tuple[str, ...] = ()
    reasons: dict[str, list[str]] = field(default_factory=dict)  # consumer -> why not (empty: it serves)

    def serves(self, name: str) -> bool:
        return not self.reasons[name]

    @property
    def served(self) -> list[str]:
        return [n for n in self.reasons if self.serves(n)]

    @property
    def unserved(self) -> list[str]:
        return [n for n in self.reasons if not self.serves(n)]

    def engines_for(self, layer: int) -> list[str]:
        """The engines that can serve a drafter holding tap ``layer``."""
        return [e for e in ENGINES if CONSUMERS[e].refuses(layer, self.num_layers) is None]

    def engine_warnings(self) -> list[str]:
        """One line per drafter tap that some engine refuses: the tap, each refusal, and the engines that can."""
        lines = []
        for l in self.layers:
            why = [(e, CONSUMERS[e].refuses(l, self.num_layers)) for e in ENGINES]
            why = [(e, w) for e, w in why if w]
            if why:
                can = self.engines_for(l)
                lines.append(f"tap {l} ({tensor_of(l, self.num_layers)}): "
                             + "; ".join(f"{e} cannot serve it ({w})" for e, w in why)
                             + (f"; served by {', '.join(can)}" if can else "; no engine serves it"))
        return lines

    def summary(self) -> str:
        """One line: which consumers the taps serve, and why each of the others does not."""
        head = (f"taps {','.join(map(str, self.layers))} (each its decoder layer's output, before the final norm) "
                f"serve {', '.join(self.served) or 'nothing'}")
        rest = [f"{n} ({self.reasons[n][0]})" for n in self.unserved]
        return head + (f"; not {', '.join(rest)}" if rest else "")


def serving(layers: Iterable[int], num_layers: int, features: Iterable[str] = ()) -> Serving:
    """Who serves a store of ``layers`` (hsstore ids) and ``features`` of a ``num_layers`` target."""
    layers, feats = list(layers), tuple(features)
    s = Serving(layers, num_layers, feats)
    for name, c in CONSUMERS.items():
        why = []
        if c.kind == "engine":
            why += [f"tap {l}: {w}" for l in layers if (w := c.refuses(l, num_layers))]
        missing = [l for l in c.needs(num_layers) if l not in layers]
        if name == "specforge-eagle3":  # any 3 taps do (min_taps): the default ones are what --serve adds
            missing = []
        if missing:
            why.append(f"needs layer{'s' if len(missing) > 1 else ''} {','.join(map(str, missing))}"
                       + (f" ({tensor_of(missing[0], num_layers)})" if len(missing) == 1 else ""))
        if len(layers) < c.min_taps:
            why.append(f"needs at least {c.min_taps} taps, the store has {len(layers)}")
        why += [f"needs {f} (--final-hidden)" for f in c.features if f not in feats]
        s.reasons[name] = why
    return s


def taps_for(serve: Sequence[str], num_layers: int, layers: Sequence[int]) -> tuple[list[int], bool]:
    """(taps, final_hidden) that serve every consumer in ``serve``: ``layers`` (the drafter's: given or DFlash's
    default) with what each needs added, sorted. Refuses (ValueError, one line naming the tap and the reason) when a
    requested engine cannot serve a tap that the set needs: a drafter trained on the store uses every tap."""
    taps = set(layers)
    final = False
    for name in serve:
        c = CONSUMERS[name]
        taps |= set(c.needs(num_layers))
        final = final or "final_hidden" in c.features
    out = sorted(t for t in taps if 0 <= t < num_layers)
    bad = sorted(t for t in taps if not 0 <= t < num_layers)
    if bad:
        raise ValueError(f"--serve {','.join(serve)}: layer {bad[0]} is past a {num_layers}-layer target "
                         f"(valid ids 0..{num_layers - 1})")
    for name in serve:
        c = CONSUMERS[name]
        for l in out:
            why = c.refuses(l, num_layers)
            if why:
                wanted = [n for n in serve if l in CONSUMERS[n].needs(num_layers)]
                by = f" (needed by {', '.join(wanted)})" if wanted else ""
                raise ValueError(f"--serve {','.join(serve)}: tap {l}{by}: {why}; no tap set serves them all "
                                 f"(engines that serve tap {l}: {', '.join(serving(out, num_layers).engines_for(l))})")
    return out, final


@dataclass
class TapPlan:
    """The taps and features an extraction will store, and who they serve."""

    layers: list[int]
    final_hidden: bool
    serving: Serving

    def lines(self) -> list[str]:
        """What a command says before extracting: the taps' tensor, who they serve, and each engine warning."""
        return [self.serving.summary()] + [f"warning: {w}" for w in self.serving.engine_warnings()]


def plan(num_layers: int, layers: Sequence[int] | None = None, serve: Sequence[str] = (),
         final_hidden: bool = False) -> TapPlan:
    """``--layers`` (checked; else DFlash's spacing) with what ``--serve`` needs added (:func:`taps_for`), and
    ``final_hidden`` when asked or needed; ValueError (one line naming the tap) where nothing could serve them."""
    base = check_taps(list(layers), num_layers) if layers else default_taps(num_layers)
    taps, needs_final = taps_for(list(serve), num_layers, base)
    final = bool(final_hidden or needs_final)
    return TapPlan(taps, final, serving(taps, num_layers, ("final_hidden",) if final else ()))
