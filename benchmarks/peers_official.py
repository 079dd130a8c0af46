"""The official side of the peers benchmark (`benchmarks.peers`): the PyTorch training steps of AGF and
SAMoVAR, built from the user's checkouts (no official code lives in this repository).

`official_source` finds a case's checkout (or says why its official side is skipped), and
`official_step(src, case, ours, tiny, seed, device, precision)` returns `(step, info)`: a callable running
one training step (forward, backward, optimiser) on a fixed batch, the same token ids / series as our
step's batch where the shapes allow it, on `device` ('cpu' or 'cuda') in `precision` (`PRECISIONS`).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import pathlib
import sys
from typing import Any, Callable

from zoo_core import extras

# The official files each case needs, relative to --agf_src / --samovar_src.
OFFICIAL_FILES = {
    "agf_listops": ("agf", "AGF_LRA/model_wrapper.py"),
    "agf_softmax": ("agf", "AGF_LRA/model_wrapper.py"),
    "samovar_fig4": ("samovar", "models/AutoregressiveAlignment.py"),
    "lintrans": ("samovar", "models/Autoregressive.py"),
    "agf_uea_jv": ("agf", "AGF_UEA/main.py"),
}
OFFICIAL_REPOS = {"agf": "github:jeongwhanchoi/agf", "samovar": "github:LJC-FVNR/Structural-Aligned-Mixture-of-VAR"}
# 'fp32': torch's default (TF32 off); 'tf32': TF32 matmuls and convolutions; 'amp': fp16 autocast with a
# GradScaler, what the official LRA `run_tasks.py` sets for every task (CUDA only).
PRECISIONS = ("fp32", "tf32", "amp")
# `best_agf.sh`'s listops line.
AGF_LISTOPS_FILTER = dict(poly_type="jacobi", K=5, alpha=2.0, beta=-1.0, fixI=True, reg=0.01)


@contextlib.contextmanager
def _on_path(folder: pathlib.Path):
    """Imports from `folder` (the official code imports its siblings by bare name)."""
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))


def _load_module(path: pathlib.Path, name: str):
    with _on_path(path.parent):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def _grad_scaler():
    import torch

    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda")
    return torch.cuda.amp.GradScaler()   # torch < 2.3


def _train_step(opt, loss_fn: Callable[[], Any], device: str, precision: str, sched=None) -> Callable[[], None]:
    """One optimiser step of `loss_fn()` in `precision`; the final `.item()` waits for the device."""
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {PRECISIONS}")
    if precision != "fp32" and device != "cuda":
        raise ValueError(f"precision {precision!r} needs device 'cuda', got {device!r}")
    scaler = _grad_scaler() if precision == "amp" else None
    tf32 = precision == "tf32"

    def step():
        # Global switches: set on every call, since the precisions' steps alternate in one process.
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        opt.zero_grad()
        with torch.autocast(device_type=device, dtype=torch.float16, enabled=scaler is not None):
            loss = loss_fn()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if sched is not None:
            sched.step()
        loss.item()

    return step


def _official_agf_lra(src: pathlib.Path, case: str, ours: Any, tiny: bool, seed: int, device: str,
                      precision: str):
    import numpy as np
    import torch

    folder = src / "AGF_LRA"
    with _on_path(folder):
        for name in ("lra_config", "model_wrapper", "model", "attention", "attention_svd", "polyconv"):
            sys.modules.pop(name, None)   # another checkout's modules of the same names
        lra_config = importlib.import_module("lra_config")
        model_wrapper = importlib.import_module("model_wrapper")
        attn_type = "svd" if case == "agf_listops" else "softmax"
        cfg = dict(lra_config.config["listops"]["model"])
        cfg.update(lra_config.config["listops"]["extra_attn_config"][attn_type])
        train_cfg = lra_config.config["listops"]["training"]
        if ours is not None:
            ids = np.asarray(ours.batch["inputs"]).astype(np.int64)
            labels = np.asarray(ours.batch["label"]).astype(np.int64)
        else:
            rng = np.random.default_rng(seed)
            b, n = (4, 64) if tiny else (train_cfg["batch_size"], cfg["max_seq_len"])
            ids = rng.integers(1, 16, size=(b, n))
            labels = rng.integers(0, cfg["num_classes"], size=(b,))
        ids = np.minimum(ids, cfg["vocab_size"] - 1)
        cfg["max_seq_len"] = int(2 ** math.ceil(math.log2(max(cfg["max_seq_len"], ids.shape[1]))))
        cfg.update(mixed_precision=False, attn_type=attn_type, num_layers=2, task="listops", skip_train=0)
        if attn_type == "svd":
            cfg.update(AGF_LISTOPS_FILTER)
        else:
            cfg.update(poly_type="None", K="0", reg=0, alpha=1.0, beta=0.2, fixI=False)
        torch.manual_seed(seed)
        model = model_wrapper.ModelForSC(cfg)
    model.to(device).train()
    batch = dict(input_ids_0=torch.from_numpy(ids), mask_0=torch.from_numpy((ids != 0).astype(np.float32)),
                 label=torch.from_numpy(labels))
    batch = {k: v.to(device) for k, v in batch.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=train_cfg["learning_rate"], betas=(0.9, 0.999), eps=1e-6,
                            weight_decay=train_cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=train_cfg["learning_rate"], pct_start=train_cfg["warmup"] / train_cfg["num_train_steps"],
        anneal_strategy=train_cfg["lr_decay"], total_steps=10**6)

    step = _train_step(opt, lambda: model(**batch)["loss"].mean(), device, precision, sched)
    info = dict(file="AGF_LRA/model_wrapper.py::ModelForSC", device=device, precision=precision,
                attn_type=attn_type, batch=list(ids.shape),
                max_seq_len=cfg["max_seq_len"], num_params=sum(p.numel() for p in model.parameters()))
    return step, info


# The Fig. 4 notebook's `ARMAConfig` (visualization/model_visualize.ipynb), as the fields the models/
# constructors read (number_of_targets 0 = all channels, as the goldens; the notebook's 2 = C).
FIG4_CONFIG = dict(seq_len=64, pred_len=1, label_len=64, enc_in=2, number_of_targets=0, d_model=32, dropout=0.1,
                   e_layers=3, n_heads=2, predictor="LinearAttention", time_emb_dim=0, univariate=0, features="M")
LINTRANS_WINDOW = 8   # local_attention_window * pred_len: LinTrans sees the last 8 steps


def _official_samovar(src: pathlib.Path, case: str, ours: Any, tiny: bool, seed: int, device: str,
                      precision: str):
    import types

    import numpy as np
    import torch
    import torch.nn.functional as F

    file = "Autoregressive.py" if case == "lintrans" else "AutoregressiveAlignment.py"
    module = _load_module(src / "models" / file, f"_official_{case}")
    config = types.SimpleNamespace(**FIG4_CONFIG)
    batch_size = 256
    if ours is not None:
        batch_size = int(np.shape(next(iter(ours.batch.values())))[0])
    elif tiny:
        batch_size = 4
    torch.manual_seed(seed)
    model = module.Model(config)
    model.to(device).train()
    rng = np.random.default_rng(seed)
    x_i = torch.from_numpy(rng.standard_normal((batch_size, config.seq_len, config.enc_in), dtype=np.float32))
    x_p = torch.from_numpy(rng.standard_normal((batch_size, config.pred_len, config.enc_in), dtype=np.float32))
    x_i, x_p = x_i.to(device), x_p.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def loss_fn():
        # The notebook's model_forward_* (channel-drop augmentation included) and its training loop.
        xi = x_i[:, -LINTRANS_WINDOW:, :] if case == "lintrans" else x_i
        drop_rate = torch.rand(1).item()
        drop_mask = (torch.rand(1, 1, xi.shape[2]) < 1 - drop_rate).to(device)
        xi = xi.masked_fill(drop_mask, 0)
        xp = x_p.masked_fill(drop_mask, 0)
        output, ar_loss = model(xi)
        return F.mse_loss(output, xp) + ar_loss

    step = _train_step(opt, loss_fn, device, precision)
    info = dict(file=f"models/{file}::Model", device=device, precision=precision,
                batch=[batch_size, config.seq_len, config.enc_in],
                num_params=sum(p.numel() for p in model.parameters()))
    return step, info


def official_source(case: str, args) -> tuple[pathlib.Path | None, str | None]:
    """(checkout, None) or (None, the reason the case's official side is skipped)."""
    which, rel = OFFICIAL_FILES[case]
    src = getattr(args, f"{which}_src")
    flag = f"--{which}_src"
    if not src:
        return None, f"no official source: pass {flag} DIR (a checkout made outside this repository)"
    src = pathlib.Path(src).expanduser()
    if not (src / rel).is_file():
        return None, f"{flag} {src} has no {rel}"
    return src, None


def check_torch() -> str | None:
    absent = extras.missing("peers")
    if absent:
        return f"needs the [peers] extra ({', '.join(absent)} not installed): {extras.install_command('peers')}"
    return None


def official_step(src: pathlib.Path, case: str, ours: Any, tiny: bool, seed: int, device: str = "cpu",
                  precision: str = "fp32") -> tuple[Callable[[], None], dict]:
    """(step, info) of the official model of `case` from the checkout `src` on `device` in `precision`;
    `ours`: our step (its batch is converted for the official model), or None."""
    build = _official_agf_lra if case.startswith("agf") else _official_samovar
    return build(src, case, ours, tiny, seed, device, precision)
