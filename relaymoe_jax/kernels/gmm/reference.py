"""Float64 numpy reference for gmm / tgmm and their gradients (tests only)."""

from __future__ import annotations

import numpy as np


def group_bounds(group_sizes, m: int) -> list[tuple[int, int]]:
    """Holds [start, end) rows of each group, truncated at m (negative sizes = 0)."""
    bounds, start = [], 0
    for size in np.asarray(group_sizes).tolist():
        end = min(start + max(int(size), 0), m)
        bounds.append((start, end))
        start = end
    return bounds


def gmm(lhs, rhs, group_sizes, transpose_rhs: bool = False) -> np.ndarray:
    """Holds out[M, N] in float64; rows outside every group are 0."""
    x = np.asarray(lhs, np.float64)
    w = np.asarray(rhs, np.float64)
    if transpose_rhs:
        w = w.transpose(0, 2, 1)
    out = np.zeros((x.shape[0], w.shape[2]))
    for g, (s, e) in enumerate(group_bounds(group_sizes, x.shape[0])):
        out[s:e] = x[s:e] @ w[g]
    return out


def tgmm(lhs, rhs, group_sizes, num_groups: int | None = None) -> np.ndarray:
    """Holds out[G, K, N] = lhs[rows of g].T @ rhs[rows of g] in float64."""
    x = np.asarray(lhs, np.float64)
    y = np.asarray(rhs, np.float64)
    bounds = group_bounds(group_sizes, x.shape[0])
    out = np.zeros((num_groups or len(bounds), x.shape[1], y.shape[1]))
    for g, (s, e) in enumerate(bounds):
        out[g] = x[s:e].T @ y[s:e]
    return out


def gmm_grads(lhs, rhs, group_sizes, dout, transpose_rhs: bool = False):
    """Holds (dlhs, drhs) of sum(gmm(lhs, rhs) * dout), by hand in float64."""
    x = np.asarray(lhs, np.float64)
    w = np.asarray(rhs, np.float64)
    d = np.asarray(dout, np.float64)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    for g, (s, e) in enumerate(group_bounds(group_sizes, x.shape[0])):
        if transpose_rhs:  # out = x @ w[g].T
            dx[s:e] = d[s:e] @ w[g]
            dw[g] = d[s:e].T @ x[s:e]
        else:  # out = x @ w[g]
            dx[s:e] = d[s:e] @ w[g].T
            dw[g] = x[s:e].T @ d[s:e]
    return dx, dw


def tgmm_grads(lhs, rhs, group_sizes, dout):
    """Holds (dlhs, drhs) of sum(tgmm(lhs, rhs) * dout), by hand in float64."""
    x = np.asarray(lhs, np.float64)
    y = np.asarray(rhs, np.float64)
    d = np.asarray(dout, np.float64)
    dx, dy = np.zeros_like(x), np.zeros_like(y)
    for g, (s, e) in enumerate(group_bounds(group_sizes, x.shape[0])):
        dx[s:e] = y[s:e] @ d[g].T
        dy[s:e] = x[s:e] @ d[g]
    return dx, dy
