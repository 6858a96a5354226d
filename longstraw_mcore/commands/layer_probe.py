"""What a validation step touched, for the receipt: forward calls per decoder layer on each rank and,
for MoE layers, the token-to-expert assignments per expert (summed over ranks) with the expert-parallel
rank that holds each expert. Hooks only observe (no tensor is changed or kept)."""

from __future__ import annotations

import torch


class LayerProbe:
    def __init__(self, model, model_cfg, ep: int = 1):
        self.m, self.ep = model_cfg, ep
        self.calls: dict[int, int] = {}
        self.tokens: dict[int, torch.Tensor] = {}
        self._handles = []
        from longstraw_mcore.models.chunks import chunk_list

        for layer in (layer for chunk in chunk_list(model) for layer in chunk.decoder.layers):  # (vpp > 1: every chunk)
            i = layer.layer_number - 1  # Megatron numbers layers globally from 1
            self.calls[i] = 0
            self._handles.append(layer.register_forward_pre_hook(self._count(i)))
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                self.tokens[i] = torch.zeros(router.weight.shape[0], dtype=torch.long)
                self._handles.append(router.register_forward_hook(self._route(i)))

    def _count(self, i):
        def hook(module, args):
            self.calls[i] += 1
        return hook

    def _route(self, i):
        def hook(module, args, out):
            self.tokens[i] += out[1].detach().sum(0).to("cpu", torch.long)  # (probs, routing_map [tokens, E])
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def report(self) -> dict:
        """This rank's part: {layer: calls}, {layer: tokens per expert}."""
        return {"calls": dict(self.calls), "tokens": {i: t.tolist() for i, t in self.tokens.items()}}


def merge_reports(reports: list[dict], model_cfg, ep: int) -> dict:
    """Every rank's `report()` -> the receipt's `layers` list (one entry per decoder layer)."""
    m = model_cfg
    mlp = getattr(m, "mlp_types", None)
    layers = []
    for i, kind in enumerate(m.layer_types):
        calls = [r["calls"].get(i, 0) for r in reports]
        entry = {"layer": i, "type": kind, "ranks_touched": [k for k, c in enumerate(calls) if c],
                 "forward_calls_per_rank": calls}
        if mlp is not None:
            entry["mlp"] = mlp[i]
        counts = [r["tokens"][i] for r in reports if i in r["tokens"]]
        if counts:
            E = len(counts[0])
            total = [sum(c[e] for c in counts) for e in range(E)]
            entry["tokens_per_expert"] = total
            entry["experts_touched"] = sum(1 for t in total if t)
            entry["ep_rank_of_expert"] = [e // (E // ep) for e in range(E)]
        layers.append(entry)
    return {"layers": layers, "layers_touched": sum(1 for e in layers if e["ranks_touched"]),
            "num_layers": m.num_layers}
