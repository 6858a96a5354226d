"""planner/activations.py against what autograd really keeps: every tensor a branch's forward saves for
its backward (torch.autograd.graph.saved_tensors_hooks, each storage counted once, parameters and the
prompt state's own buffers left out), per layer, for Gated DeltaNet and gated-attention layers of
configs whose dimensions all differ (so a term with the wrong dimension cannot match), in bfloat16,
float32 and float64, at TP=1 and TP=2, and at TP=1 with LoRA on the frozen base (planner/adapters.py
frozen_base_activation_delta added); GLM-5.2-tiny's MLA + DSA layers with a dense and a MoE MLP; GLM-5.3-Flash-tiny's
KDA, full and shared pooled MLA layers in their hyper-connection streams (planner/activations_glm5_next.py). The
formulas are derived from the code, not fitted: each must
be within 10% of the count (the residue is small shape-independent tensors and padding copies)."""

from __future__ import annotations

from longstraw_mcore.launch_local import run_ranks

CASES = [  # (dtype, tp, T, overrides)
    ("bfloat16", 1, 32, dict(hk=2, hv=6, dk=12, dv=20, C=8, Hd=48, F=40, qh=6, kvh=2, hd=40)),
    ("float32", 1, 48, dict(hk=3, hv=3, dk=16, dv=8, C=16, Hd=64, F=96, qh=3, kvh=1, hd=16)),
    ("float64", 1, 64, dict(hk=1, hv=3, dk=24, dv=16, C=32, Hd=32, F=160, qh=4, kvh=2, hd=24)),
    ("float32", 2, 48, dict(hk=2, hv=4, dk=12, dv=20, C=8, Hd=48, F=64, qh=4, kvh=2, hd=16)),
]
GLM_CASES = [("float32", 24), ("bfloat16", 40)]  # configs/glm-5.2-tiny.yaml at 4 layers: dense 0-2, MoE 3
GLM5_CASES = [("float32", 29), ("bfloat16", 13)]  # configs/glm5.3-flash-tiny.yaml at 4 layers (see _worker)


def _overrides(dtype, d):
    return [f"model.linear_num_key_heads={d['hk']}", f"model.linear_num_value_heads={d['hv']}",
            f"model.linear_key_head_dim={d['dk']}", f"model.linear_value_head_dim={d['dv']}",
            f"model.gdn_chunk_size={d['C']}", f"model.hidden_size={d['Hd']}", f"model.intermediate_size={d['F']}",
            f"model.num_attention_heads={d['qh']}", f"model.num_key_value_heads={d['kvh']}",
            f"model.head_dim={d['hd']}", f"model.dtype={dtype}", "model.num_layers=4", "device=cpu"]


def _saved_per_layer(model, state, ids, P) -> dict[int, int]:
    import torch

    from longstraw_mcore.prompt_state.contexts import ReplayContext

    stack = [None]
    for name, mod in model.named_modules():
        parts = name.split(".")
        if len(parts) == 3 and parts[:2] == ["decoder", "layers"]:
            mod.register_forward_pre_hook(lambda mod, a, i=int(parts[2]): (stack.append(i), None)[1])
            mod.register_forward_hook(lambda mod, a, o: (stack.pop(), None)[1])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, per = set(), {}

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in seen or key in params or st.nbytes() == 0 or stack[-1] is None:
            return t
        seen.add(key)
        if (P - 1) not in t.shape:  # the prompt's K/V (the state itself) are not activations
            per[stack[-1]] = per.get(stack[-1], 0) + st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.forward_hidden(ids, ReplayContext(state, batch=1, store_probs=False, layout=None))
    return per


def _worker(rank, world_size, tp):
    import os

    import torch

    from longstraw_mcore.config import load_config
    from longstraw_mcore.families import get_family
    from longstraw_mcore.parallel.groups import setup_parallel
    from longstraw_mcore.planner.activations import layer_bytes
    from longstraw_mcore.replay.engine import capture

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rows = []
    from longstraw_mcore.adapters.attach import attach
    from longstraw_mcore.planner.adapters import frozen_base_activation_delta

    for dtype, case_tp, T, d in CASES:
        if case_tp != tp:
            continue
        # at TP=1 also with LoRA r1 on the frozen base: what the base does not keep, what the adapters add
        for adapter in ([], ["adapter.rank=1"]) if tp == 1 else ([],):
            cfg = load_config(os.path.join(root, "configs", "qwen3.6-tiny.yaml"),
                              _overrides(dtype, d) + [f"parallel.tp={tp}"] + adapter)
            m = cfg.model
            family = get_family(m.family)
            par = setup_parallel(cfg)
            model = family.build_model(m, par, "cpu")
            if adapter:
                attach(model, family.checkpoint.adapter_sites(m), cfg.adapter, par, cfg.seed,
                       padded_vocab=model.padded_vocab_size)
            g = torch.Generator().manual_seed(0)
            P = 38  # 37 prompt positions: no other dimension is 37
            state = capture(model, torch.randint(0, m.vocab_size, (1, P - 1), generator=g), cfg.replay)
            per = _saved_per_layer(model, state, torch.randint(0, m.vocab_size, (1, T), generator=g), P)
            # Gated DeltaNet, gated attention; with adapters also layer 1 (layer 0's input norm keeps less
            # still: its input, the frozen embedding's output, needs no gradient)
            for layer in (0, 3) if not adapter else (0, 1, 3):
                want = layer_bytes(family.layers, m, tp, T, layer)
                if adapter:
                    want += frozen_base_activation_delta(family, m, cfg.adapter, tp, T, layer)
                rows.append((dtype, tp, m.layer_types[layer] + ("+lora" if adapter else ""), T, per[layer], want))
    for dtype, T in GLM_CASES if tp == 1 else []:
        cfg = load_config(os.path.join(root, "configs", "glm-5.2-tiny.yaml"),
                          [f"model.dtype={dtype}", "model.num_layers=4", "device=cpu"])
        m = cfg.model
        model = get_family(m.family).build_model(m, setup_parallel(cfg), "cpu")
        g = torch.Generator().manual_seed(0)
        P = 38
        state = capture(model, torch.randint(0, m.vocab_size, (1, P - 1), generator=g), cfg.replay)
        per = _saved_per_layer(model, state, torch.randint(0, m.vocab_size, (1, T), generator=g), P)
        for layer in (1, 3):  # MLA + dense MLP, MLA + MoE
            kind = f"mla_{m.mlp_types[layer]}"
            rows.append((dtype, tp, kind, T, per[layer], layer_bytes(get_family(m.family).layers, m, tp, T, layer, keys=P - 1 + T)))
    for dtype, T in GLM5_CASES if tp == 1 else []:  # KDA + dense, MLA full + MoE, MLA shared + MoE; 4 streams
        import dataclasses

        cfg = load_config(os.path.join(root, "configs", "glm5.3-flash-tiny.yaml"),
                          [f"model.dtype={dtype}", "device=cpu"])
        m = dataclasses.replace(cfg.model, num_layers=4, mixer_types=["linear_attention", "indexed_attention",
                                                                      "indexed_attention", "linear_attention"],
                                indexer_types=["full", "full", "shared", "full"],
                                mlp_layer_types=["dense", "sparse", "sparse", "dense"])
        cfg = dataclasses.replace(cfg, model=m)
        model = get_family(m.family).build_model(m, setup_parallel(cfg), "cpu")
        g = torch.Generator().manual_seed(0)
        P = 38
        state = capture(model, torch.randint(0, m.vocab_size, (1, P - 1), generator=g), cfg.replay)
        per = _saved_per_layer(model, state, torch.randint(0, m.vocab_size, (1, T), generator=g), P)
        for layer in (0, 1, 2):
            kind = f"glm5 {m.layer_types[layer]}+{m.mlp_types[layer]}"
            rows.append((dtype, tp, kind, T, per[layer], layer_bytes(get_family(m.family).layers, m, tp, T, layer,
                                                                     keys=P - 1 + T)))
    return rows


def test_activation_formulas_match_saved_tensors():
    rows = run_ranks(_worker, 1, 1, timeout_s=600)[0] + run_ranks(_worker, 2, 2, timeout_s=600)[0]
    for dtype, tp, kind, T, got, want in rows:
        print(f"{dtype:9s} tp={tp} {kind:28s} T={T}: saved {got:8d} B, formula {want:8d} B ({want / got:.3f})")
    assert len(rows) == 21 + 6
    for dtype, tp, kind, T, got, want in rows:
        assert abs(want / got - 1) <= 0.10, (dtype, tp, kind, T, got, want)
