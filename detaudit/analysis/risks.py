"""Settings in a captured environment that can make runs differ (torch-free: it reads the
environment a trace recorded, so a saved run's report can show them)."""

from __future__ import annotations

from typing import Any


def risks(env: dict[str, Any]) -> dict[str, str]:
    """Settings in a captured environment that can make runs differ, with the reason."""
    out: dict[str, str] = {}
    cuda = bool(env.get("cuda_available"))
    if not env.get("deterministic_algorithms"):
        out["deterministic_algorithms"] = (
            "off: ops with nondeterministic kernels (index_put_ accumulate, scatter_add_, "
            "roi_align backward on CUDA, ...) run without a warning"
        )
    if env.get("PYTHONHASHSEED") in (None, "random"):
        out["PYTHONHASHSEED"] = (
            "unset: set/dict-of-str iteration order changes per process (label maps built "
            "from sets, file lists); export PYTHONHASHSEED=0 before Python starts (set in "
            "a script, it reaches only the processes the script starts)"
        )
    if (env.get("threads") or 1) > 1:
        out["threads"] = (
            f"{env['threads']} threads: CPU reductions and convolutions are reproducible only "
            "at the same thread count; compare runs with the same torch.set_num_threads"
        )
    if not env.get("OMP_NUM_THREADS"):
        out["OMP_NUM_THREADS"] = "unset: the thread count follows the machine's cores"
    if env.get("mkl") and not env.get("MKL_CBWR") and not str(env.get("device") or "").startswith(
            "cuda"):
        out["MKL_CBWR"] = (
            "unset: Intel MKL (CPU matmuls, convolutions oneDNN does not take) may pick code "
            "paths that give other results from run to run at one thread count on some CPUs; "
            "export MKL_CBWR=AUTO (COMPATIBLE to agree across machines)")
    if cuda:
        if env.get("cudnn_benchmark"):
            out["cudnn_benchmark"] = "on: cuDNN picks algorithms per run by timing them"
        if not env.get("cudnn_deterministic"):
            out["cudnn_deterministic"] = "off: cuDNN may choose nondeterministic algorithms"
        if env.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
            out["CUBLAS_WORKSPACE_CONFIG"] = (
                "not :4096:8 or :16:8: cuBLAS matmuls may be nondeterministic (CUDA >= 10.2)"
            )
        if env.get("tf32_matmul") or env.get("tf32_cudnn"):
            out["tf32_matmul" if env.get("tf32_matmul") else "tf32_cudnn"] = (
                "TF32 on: deterministic, but results differ from other GPUs and from CPU"
            )
    return out
