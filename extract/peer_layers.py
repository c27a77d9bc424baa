"""The peers' layer-id conventions, converted to this project's ids (docs/FORMAT.md, "Layer ids of the peers").

hsstore id ``l`` is the output of decoder layer ``l`` (0-based), HF ``hidden_states[l + 1]``. The peers count
differently, and the same list of numbers means different layers in each:

* **SpecForge** (its ``aux_hidden_state_layer_ids`` / ``dflash_config.target_layer_ids``) names layer *outputs*
  as hsstore does; SGLang then captures at ``id + 1`` (the residual entering the next layer, the same tensor).
  Default EAGLE-3 taps ``[1, N//2 - 1, N - 4]`` (``hsstore.format.serving.specforge_eagle3_ids``). Offset 0.
* **speculators / vLLM** (``eagle_aux_hidden_state_layer_ids``): id ``i`` is the residual stream *entering*
  decoder layer ``i``, i.e. after layer ``i - 1`` (id 0 is the embedding output, id ``N`` the last layer's
  output before the final norm). ``launch_vllm.py`` defaults to ``[2, N//2, N-3]`` plus ``N`` (the slot its
  trainer splits off as ``verifier_last_hidden_states``). hsstore id = vLLM id - 1.

A ``--layers`` list for a peer's files is taken as hsstore ids; one that reads like the peer's own ids (its
launch defaults, or the id ``N`` that only the peer has) is refused unless the user says which is meant.
"""

from __future__ import annotations

from hsstore.format.serving import CONSUMERS

PEER_OFFSET = {"specforge": 0, "speculators": 1}  # hsstore id = peer id - offset
PEER_CONVENTION = {"specforge": "specforge (output of decoder layer k, as hsstore; SGLang captures at k+1)",
                   "speculators": "vllm (residual stream entering decoder layer i = output of layer i-1)"}


def parse_ids(text: str, flag: str) -> list[int]:
    """Comma-separated layer ids; an error names the flag and the item that is not an integer."""
    out = []
    for x in (x.strip() for x in text.split(",")):
        if not x:
            continue
        try:
            out.append(int(x))
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {x!r} is not a layer id (expected comma-separated integers, "
                             "e.g. 1,16,31)") from None
    return out


def vllm_launch_ids(num_layers: int, include_last: bool = True) -> list[int]:
    """speculators' ``launch_vllm.py`` default: ``[2, N//2, N-3]`` and, with ``--include-last-layer`` (its
    default), ``N``."""
    n = num_layers
    return [2, n // 2, n - 3] + ([n] if include_last else [])


EAGLE3 = CONSUMERS["specforge-eagle3"]  # the registry's SpecForge EAGLE-3: its default taps, and their count
EAGLE3_TAPS = EAGLE3.min_taps  # its model concatenates exactly three target layers (fc takes 3 x hidden)


def eagle3_taps(store_layers: list[int], num_layers: int, chosen: list[int] | None = None,
                ) -> tuple[list[int], str | None]:
    """(the three store layers an EAGLE-3 export feeds SpecForge, a note saying which were chosen, or None).

    ``chosen`` (hsstore ids) must be three of the store's layers. Without it a store of exactly three gives them;
    one of more gives, for each of SpecForge's default capture layers ``[1, N//2 - 1, N - 4]`` in turn, the
    nearest store layer not taken yet (ties: the lower), and the note names them and the flag that chooses
    others."""
    if chosen is not None:
        chosen = list(chosen)
        if len(chosen) != EAGLE3_TAPS or len(set(chosen)) != EAGLE3_TAPS or set(chosen) - set(store_layers):
            raise ValueError(f"--layers {chosen}: EAGLE-3 takes exactly {EAGLE3_TAPS} distinct layers of the store "
                             f"({store_layers})")
        return sorted(chosen), None
    if len(store_layers) < EAGLE3_TAPS:
        raise ValueError(f"the store taps {store_layers}: SpecForge's EAGLE-3 model takes exactly {EAGLE3_TAPS} "
                         "target layers")
    if len(store_layers) == EAGLE3_TAPS:
        return list(store_layers), None
    default = EAGLE3.needs(num_layers)
    taps: list[int] = []
    for d in default:
        taps.append(min((l for l in store_layers if l not in taps), key=lambda l: (abs(l - d), l)))
    taps.sort()
    return taps, (f"EAGLE-3 takes 3 of the store's {len(store_layers)} taps {store_layers}: {taps} (nearest to "
                  f"SpecForge's defaults {default}; --layers A,B,C chooses others); train with "
                  f"aux_hidden_state_layer_ids {taps}")


def to_hsstore(peer: str, peer_ids: list[int], num_layers: int) -> list[int]:
    """The hsstore ids of ``peer_ids`` given in ``peer``'s convention; refuses ids with no hsstore id."""
    off = PEER_OFFSET[peer]
    lo, hi = off, num_layers - 1 + off
    bad = [i for i in peer_ids if not lo <= i <= hi]
    if bad:
        extra = " (vLLM id 0 is the embedding output, not a layer's)" if peer == "speculators" and 0 in bad else ""
        raise ValueError(f"--peer-layers {bad} out of range for {peer}'s convention on a {num_layers}-layer target: "
                         f"valid {lo}..{hi}{extra}")
    return [i - off for i in peer_ids]


def from_hsstore(peer: str, layers: list[int]) -> list[int]:
    return [l + PEER_OFFSET[peer] for l in layers]


def ambiguity(peer: str, layers: list[int], num_layers: int) -> str | None:
    """Why a ``--layers`` list (meant as hsstore ids) may well be ``peer``'s own ids, or None. Only speculators'
    convention differs from hsstore's, so only its lists can be ambiguous."""
    if PEER_OFFSET[peer] == 0:
        return None
    n = num_layers
    if n in layers:
        return (f"it holds {n}, vLLM's id of the last layer's output: hsstore ids stop at {n - 1} "
                f"(that same layer)")
    if layers[:3] == vllm_launch_ids(n, include_last=False):
        return (f"it starts with {vllm_launch_ids(n, False)}, speculators' default vLLM launch ids for a {n}-layer "
                f"target (hsstore ids {to_hsstore(peer, vllm_launch_ids(n, False), n)})")
    return None
