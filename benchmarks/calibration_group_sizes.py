"""How the calibrated layouts' errors depend on the group size, and where the attention goes (sink / body / recent),
from a calibration's saved statistics (no model run).

    python calibration_scripts/calibrate_oscar.py --model gemma3 --text hf_kvint2/data/prideprejudice.txt \\
        --output runs/gemma3-oscar --save-statistics runs/gemma3-stats.safetensors
    python benchmarks/calibration_group_sizes.py --statistics runs/gemma3-stats.safetensors \\
        --out benchmarks/results/calibration_group_sizes_gemma3

For every calibrated layer: the attention-output error on the held-back window (the calibration's own measure:
sink and recent windows exact, body quantized) of keys per channel in the model basis (what the calibration chose
on Gemma 3; KIVI-2's key layout) and of values per token in their spectral basis, over groups of 32-256; the
values as KIVI-2 stores them (per token over 32 channels, no rotation); and the share of the sampled queries'
attention on the sink window, the first token and the quantized body. Scale bits per element: 32 / group size
(fp16 scale and zero point).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--statistics", required=True, help="file of calibrate_oscar.py --save-statistics")
    p.add_argument("--sink", type=int, default=64, help="full-precision sink tokens of the simulated cache (64)")
    p.add_argument("--recent", type=int, default=256, help="full-precision recent tokens of the simulated cache (256)")
    p.add_argument("--out", required=True, help="output prefix (.json)")
    args = p.parse_args(argv)
    import torch

    from hf_kvint2.calibration import CalibrationData, Candidate, LayerErrorProbe, candidate_transforms
    from hf_kvint2.recipes import GroupLayout

    torch.set_num_threads(1)
    data = CalibrationData.load(args.statistics)
    d = data.head_dim
    sizes = [g for g in (32, 64, 128, 256) if g <= d]
    layers = {}
    for idx in data.calibrated_layers:
        probe = LayerErrorProbe([w[idx] for w in data.held_out], args.sink, args.recent, torch.float16)
        stats = data.stats[idx]
        krot, kmean, kev = candidate_transforms(stats, "key", "channel", False, d)
        vrot, vmean, vev = candidate_transforms(stats, "value", "spectral", False, d)
        key = {g: probe.error("key", Candidate("k", GroupLayout("channel", g), krot, kmean, kev)) for g in sizes}
        value = {g: probe.error("value", Candidate("v", GroupLayout("token", g, 0.92), vrot, vmean, vev))
                 for g in sizes}
        kivi_v = probe.error("value", Candidate("v", GroupLayout("token", 32), torch.eye(d), None, None))
        win = probe.windows[0]
        probs, body = win["probs"], win["body"]
        mass = {"sink": probs[..., :args.sink].sum(-1).mean().item(), "first_token": probs[..., 0].mean().item(),
                "body": (probs * body).sum(-1).mean().item()}
        layers[idx] = {"key_channel": key, "value_spectral": value, "value_kivi2": kivi_v, "attention_mass": mass}
        print(f"layer {idx}: K per channel " + ", ".join(f"g{g} {e:.3e}" for g, e in key.items())
              + " | V spectral " + ", ".join(f"g{g} {e:.3e}" for g, e in value.items())
              + f" | V KIVI-2 {kivi_v:.3e} | mass sink {mass['sink']:.4f} first {mass['first_token']:.1e} "
              f"body {mass['body']:.3f}")
    result = {"statistics": args.statistics, "info": data.info, "sink": args.sink, "recent": args.recent,
              "layers": layers, "command": "python benchmarks/calibration_group_sizes.py " + " ".join(
                  argv if argv is not None else __import__("sys").argv[1:]),
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
