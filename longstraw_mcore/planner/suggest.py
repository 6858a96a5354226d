"""`longstraw plan --suggest`: the fastest plan that fits, searched over layouts and memory switches.

Each candidate is the user's config (its file and overrides, as one dict) plus the candidate's
`key=value` overrides, loaded by the command line's own loader (config/loader.py), so the configs'
checks decide what is valid: a candidate they refuse (ConfigError) is skipped. The user's mode,
adapter section, dtype and replay settings are kept; the search sets, for --gpus N:

    layout    tp: powers of two up to 8; cp: powers of two; pp: even stages, divisors of num_layers up
              to 8 (uneven parallel.pp_layers are not searched), and at pp > 1 vpp 1, 2, 4 where pp x vpp
              divides num_layers (interleaved stages: a smaller bubble, more micro-batches in flight,
              planner/timing.py); dp = N / (tp cp pp); ep: the largest
              power of two the config accepts (fewer experts per rank; the time model has no EP term);
              with cp > 1 and model.gdn_cp=auto (the hybrid family), both Gated DeltaNet paths where the
              key heads split over tp x cp (model.gdn_cp=heads and =sequence; the sequence path
              alone where they do not): the time model counts the sequence path's wider rule and scan
              (planner/flops_hybrid.py) but no collective, so heads wins where both fit
    switches  memory.recompute none | layer; with layer, memory.state_offload and memory.state_dtype
              model | fp8 (the config refuses fp8 in exact mode and for float64);
              memory.optimizer_offload; train.grad_reduction step | micro_step, with micro_step
              memory.grad_offload; memory.mla_query_block
              0 | 512 for families whose state has MLA latents

Choice: the fastest plan that fits by seconds per prompt group (planner/timing.py: a group step's
total / dp, each data-parallel rank its own group), except that a simpler plan within SIMPLER_WITHIN
of it wins: state in the model dtype before fp8, then fewer switches away from the defaults, then
fewer seconds, then fewer device bytes per rank. (The time model leaves out what several switches
cost: fp8 dequantization, the query blocks' recompute, the collectives of micro_step; a few percent
of modelled time does not justify them.) A plan fits when its device bytes per rank fit the device
and its host bytes per node the host limit.
Pruning: every switch adds time or none, so a layout's plan with all switches off is a lower bound on
its plans' seconds; layouts are visited by that bound and the search stops once it passes the window
of the fastest plan that fits. When nothing fits every candidate is planned, and the closest (the
smallest excess: device bytes per rank over the device plus host bytes per node over the limit, per
rank of a node) is returned with what it misses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from longstraw_mcore.config import ConfigError, apply_overrides, load_config
from longstraw_mcore.planner.memory import node_ranks, plan_both
from longstraw_mcore.planner.timing import plan_time

OFF = {"memory.recompute": "none", "memory.state_offload": "false", "memory.state_dtype": "model",
       "memory.optimizer_offload": "false", "train.grad_reduction": "step", "memory.grad_offload": "false",
       "memory.mla_query_block": "0"}
"""Every searched switch at its default: a layout's lower bound on time."""
QUERY_BLOCK = 512
SIMPLER_WITHIN = 0.05
"""A simpler plan that fits is chosen over the fastest when its seconds are within this fraction."""
GIB = 2**30
VPP = (1, 2, 4)
"""Model chunks per pipeline rank searched (parallel.vpp: Megatron's interleaved stages, even splits)."""


@dataclass
class Candidate:
    overrides: list[str]
    cfg: object
    seconds_per_group: float
    switches_on: int
    device_bytes: int = 0
    host_node_bytes: int = 0
    misses: dict = field(default_factory=dict)

    @property
    def fp8(self) -> bool:
        return self.cfg.memory.state_dtype == "fp8"

    def key(self) -> tuple:
        """The choice among plans within SIMPLER_WITHIN of the fastest (module docstring)."""
        return (self.fp8, self.switches_on, self.seconds_per_group, self.device_bytes)

    @property
    def excess(self) -> float:
        """Bytes per rank it misses by: device over the limit plus host per node over it / ranks per node."""
        return self.misses.get("device", 0) + self.misses.get("host_per_rank", 0)


def _powers(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _load(base: dict, overrides: list[str]):
    """The candidate's RunConfig by the CLI's loader, or None when the config refuses it."""
    try:
        return load_config(None, overrides, base=base)
    except ConfigError:
        return None


def layouts(base: dict, gpus: int, num_layers: int) -> list[tuple[list[str], object]]:
    """[(layout overrides, its config with every switch off)] the config accepts on `gpus` ranks (the
    switches' defaults, OFF, come after the layout's overrides)."""
    off = [f"{k}={v}" for k, v in OFF.items()]
    reset = ["parallel.pp_layers=null"] if base.get("parallel", {}).get("pp_layers") is not None else []
    base_vpp = base.get("parallel", {}).get("vpp", 1)
    out = []
    for tp in (t for t in _powers(8) if gpus % t == 0):
        for cp in (c for c in _powers(gpus // tp) if gpus % (tp * c) == 0):
            for pp in (s for s in range(1, 9) if num_layers % s == 0 and gpus % (tp * cp * s) == 0):
                dp = gpus // (tp * cp * pp)
                for vpp in (v for v in VPP if v == 1 or (pp > 1 and num_layers % (pp * v) == 0)):
                    for ep in sorted(_powers(tp * cp * dp), reverse=True):
                        ov = [f"parallel.tp={tp}", f"parallel.cp={cp}", f"parallel.pp={pp}", f"parallel.ep={ep}"] + (
                            [f"parallel.vpp={vpp}"] if vpp > 1 or base_vpp > 1 else []) + reset
                        cfg = _load(base, ov + off)
                        if cfg is None:
                            continue
                        try:
                            cfg.parallel.dp_for(gpus)
                        except ConfigError:
                            continue
                        out.append((ov, cfg))
                        for gdn in _gdn_paths(cfg):
                            alt = _load(base, ov + [f"model.gdn_cp={gdn}"] + off)
                            if alt is not None:
                                out.append((ov + [f"model.gdn_cp={gdn}"], alt))
                        break
    return out


def _gdn_paths(cfg) -> list[str]:
    """The Gated DeltaNet paths a layout may take besides its own under CP (module docstring): the
    sequence path where model.gdn_cp=auto would shard by heads."""
    from longstraw_mcore.parallel.cp import gdn_path

    m, p = cfg.model, cfg.parallel
    return ["sequence"] if getattr(m, "gdn_cp", None) == "auto" and gdn_path(m, p.tp, p.cp) == "heads" else []


def switch_sets(mla: bool) -> list[dict]:
    """Every searched combination, as {key: value} (the staging switches only with recompute=layer)."""
    out = []
    for rec in ("none", "layer"):
        staged = [("true", "model"), ("false", "fp8"), ("true", "fp8")] if rec == "layer" else []
        staging = [("false", "model")] + staged
        for offload, dtype in staging:
            for opt in ("false", "true"):
                for red, grads in (("step", "false"), ("micro_step", "false"), ("micro_step", "true")):
                    for qb in (("0", str(QUERY_BLOCK)) if mla else ("0",)):
                        out.append({"memory.recompute": rec, "memory.state_offload": offload,
                                    "memory.state_dtype": dtype, "memory.optimizer_offload": opt,
                                    "train.grad_reduction": red, "memory.grad_offload": grads,
                                    "memory.mla_query_block": qb})
    return out


def has_mla(family, m) -> bool:
    """Whether some layer of the model keeps MLA latents (memory.mla_query_block applies)."""
    return any("mla_latent" in family.layers[t].state.analytic_bytes(m, 1, 1, 0, 1, 1) for t in set(m.layer_types))


def _time(family, cfg, P, R, G, gpus, dev, efficiency, host=None) -> float:
    zero = {"optimizer": 0, "optimizer_grads": 0, "prompt_state": 0, "prompt_state_grad": 0, "gradients": 0}
    return plan_time(family, cfg, P, R, G, gpus, dev, efficiency, host or zero)["seconds_per_group"]


def _measure(c: Candidate, family, P, R, G, gpus, dev, efficiency, host_limit: int, per_node: int) -> Candidate:
    """Plan the candidate's memory and its time with the transfers its host bytes cause."""
    device, host = plan_both(family, c.cfg, P, R, G, gpus, cuda=True)
    c.device_bytes = sum(device.values())
    c.host_node_bytes = sum(host.values()) * per_node
    c.seconds_per_group = _time(family, c.cfg, P, R, G, gpus, dev, efficiency, host)
    over_d, over_h = c.device_bytes - dev.memory_bytes, c.host_node_bytes - host_limit
    c.misses = {k: v for k, v in (("device", over_d), ("host_per_node", over_h)) if v > 0}
    if over_h > 0:
        c.misses["host_per_rank"] = over_h / per_node
    return c


class _Search:
    """The plans measured so far: those that fit, the fastest of them, the closest that does not, and
    the candidates set aside (not faster than the fastest, not simpler than the choice) to revisit when
    the choice changes."""

    def __init__(self, measure):
        self.measure, self.fitting, self.deferred = measure, [], []
        self.fastest = self.closest = None
        self.searched = 0

    def window(self) -> float:
        """Seconds per group a plan may take and still be chosen."""
        return float("inf") if self.fastest is None else self.fastest * (1 + SIMPLER_WITHIN)

    def chosen(self):
        return min((c for c in self.fitting if c.seconds_per_group <= self.window()), key=Candidate.key, default=None)

    @staticmethod
    def _loses(c: Candidate, ch) -> bool:
        """Whether `c` (its seconds still a lower bound) cannot be chosen over `ch`."""
        return ch is not None and (c.fp8, c.switches_on, c.seconds_per_group) > (ch.fp8, ch.switches_on,
                                                                               ch.seconds_per_group)

    def offer(self, c: Candidate) -> None:
        if c.seconds_per_group > self.window():
            return  # its lower bound is already out of the window
        if self.fastest is not None and c.seconds_per_group >= self.fastest and self._loses(c, self.chosen()):
            self.deferred.append(c)
            return
        self._take(c)

    def _take(self, c: Candidate) -> None:
        self.searched += 1
        self.measure(c)
        if not c.misses:
            self.fitting.append(c)
            self.fastest = c.seconds_per_group if self.fastest is None else min(self.fastest, c.seconds_per_group)
        elif self.fastest is None and (self.closest is None or (c.excess, c.seconds_per_group)
                                       < (self.closest.excess, self.closest.seconds_per_group)):
            self.closest = c

    def finish(self):
        """Revisit what was set aside against the final window and choice; the choice (or the closest)."""
        while True:
            ch = self.chosen()
            todo = [c for c in self.deferred if c.seconds_per_group <= self.window() and not self._loses(c, ch)]
            if not todo:
                return ch
            for c in todo:
                self.deferred.remove(c)
                self._take(c)


def suggest(family, base: dict, P: int, R: int, G: int, gpus: int, dev, efficiency: float | None,
            host_limit: int, gpus_per_node: int) -> dict:
    """The search (module docstring). `base`: the user's config as a dict (config_to_dict); `dev`: a
    DeviceProfile; `efficiency`: None for the device table's per-phase figures (planner/efficiency.py),
    or one fraction for every phase; `host_limit`: host bytes per node. Returns {"best": Candidate,
    "fits": bool, "searched": plans measured, "layouts": n, "seconds": wall time}."""
    t0 = time.perf_counter()
    first = load_config(None, [], base=base)
    per_node = node_ranks(gpus, gpus_per_node)
    outlines = layouts(base, gpus, first.model.num_layers)
    if not outlines:
        raise ConfigError(f"--suggest: no layout of {gpus} ranks passes the config's checks (tp in 1..8, cp and "
                          "pp as the module planner/suggest.py says); check --gpus")
    bounds = sorted(((_time(family, cfg, P, R, G, gpus, dev, efficiency), i, ov)
                     for i, (ov, cfg) in enumerate(outlines)), key=lambda x: (x[0], x[1]))
    off = [f"{k}={v}" for k, v in OFF.items()]
    sets = switch_sets(has_mla(family, first.model))
    search = _Search(lambda c: _measure(c, family, P, R, G, gpus, dev, efficiency, host_limit, per_node))
    for bound, _, ov in bounds:
        if bound > search.window():
            break  # no plan of this layout (or a later one) can be chosen
        at = apply_overrides(base, ov + off)  # the layout with every switch off, as the loader applies them
        for sw in sets:
            cfg = _load(at, [f"{k}={v}" for k, v in sw.items() if v != OFF[k]])
            if cfg is None:
                continue
            c = Candidate(ov + [f"{k}={v}" for k, v in sw.items()], cfg, 0.0, sum(sw[k] != OFF[k] for k in sw))
            c.seconds_per_group = _time(family, cfg, P, R, G, gpus, dev, efficiency)  # a lower bound
            search.offer(c)
    chosen = search.finish()
    return {"best": chosen or search.closest, "fits": chosen is not None, "searched": search.searched,
            "layouts": len(outlines), "fastest_seconds_per_group": search.fastest, "seconds": time.perf_counter() - t0}


def describe(c: Candidate, gpus: int) -> str:
    """One line: layout and switches."""
    p, m, t = c.cfg.parallel, c.cfg.memory, c.cfg.train
    sw = [f"recompute={m.recompute}", f"state_offload={str(m.state_offload).lower()}", f"state_dtype={m.state_dtype}",
          f"optimizer_offload={str(m.optimizer_offload).lower()}", f"grad_reduction={t.grad_reduction}"]
    if m.grad_offload:
        sw.append("grad_offload=true")
    if m.mla_query_block:
        sw.append(f"mla_query_block={m.mla_query_block}")
    from longstraw_mcore.parallel.cp import gdn_path

    lay = f"tp={p.tp} cp={p.cp} pp={p.pp}{f' vpp={p.vpp}' if p.vpp > 1 else ''} ep={p.ep} dp={p.dp_for(gpus)}"
    gdn = gdn_path(c.cfg.model, p.tp, p.cp)
    if gdn in ("heads", "sequence"):  # which Gated DeltaNet path under CP
        lay += f" gdn={gdn}"
    return lay + "; " + ", ".join(sw)


def miss_line(c: Candidate, gpus: int, dev, host_limit: int, searched: int) -> str:
    """The error line when nothing fits: the closest plan and by how many GiB it misses."""
    parts = []
    if "device" in c.misses:
        parts.append(f"{c.misses['device'] / GIB:.2f} GiB per rank over the device ({c.device_bytes / GIB:.2f} of "
                     f"{dev.memory_bytes / GIB:.2f} GiB)")
    if "host_per_node" in c.misses:
        parts.append(f"{c.misses['host_per_node'] / GIB:.2f} GiB per node over the host ({c.host_node_bytes / GIB:.2f} "
                     f"of {host_limit / GIB:.0f} GiB)")
    return (f"--suggest: nothing fits {gpus} x {dev.name} among {searched} plans; the closest is {describe(c, gpus)}: "
            f"{' and '.join(parts)} (its overrides: {' '.join(c.overrides)})")
