"""Find which summation order ATen's CUDA mean uses for [rows, n] FP32 (brute force over candidates)."""
import itertools

import torch

DEV = "cuda"


def emulate(x, vec, bw, mode, tree):
    R, n = x.shape
    U = 4 if mode.startswith("C") else 1
    per = vec * bw * U
    iters = -(-n // per)
    p = torch.zeros(R, iters * per, device=x.device)
    p[:, :n] = x
    if vec == 1 and mode == "A":  # vt0=4 accumulators by step
        iters4 = -(-n // (4 * bw))
        p = torch.zeros(R, iters4 * 4 * bw, device=x.device)
        p[:, :n] = x
        tile = p.view(R, iters4, 4, bw)  # elem = 4bw*i + bw*s + t
        acc = tile[:, 0]
        for i in range(1, iters4):
            acc = acc + tile[:, i]
        c = acc[:, 0]
        for s in range(1, 4):
            c = c + acc[:, s]
    elif mode == "A":  # vector-lane accumulators
        tile = p.view(R, iters, bw, vec)
        acc = tile[:, 0]
        for i in range(1, iters):
            acc = acc + tile[:, i]
        c = acc[..., 0]
        for j in range(1, vec):
            c = c + acc[..., j]
    elif mode == "B":  # one accumulator, sequential over its elements in vector order
        tile = p.view(R, iters, bw, vec)
        c = tile[:, 0, :, 0]
        for i in range(iters):
            for j in range(vec):
                if i == 0 and j == 0:
                    continue
                c = c + tile[:, i, :, j]
    else:  # C: 4 vectors per step at stride bw, accumulators (u, j)
        tile = p.view(R, iters, U, bw, vec)  # vector index = bw*(U*i + u) + t
        acc = tile[:, 0]
        for i in range(1, iters):
            acc = acc + tile[:, i]  # (R, U, bw, vec)
        if mode == "C1":  # over u first, then j
            a = acc[:, 0]
            for u in range(1, U):
                a = a + acc[:, u]
            c = a[..., 0]
            for j in range(1, vec):
                c = c + a[..., j]
        else:  # C2: flat (u, j) order
            flat = acc.permute(0, 2, 1, 3).reshape(R, bw, U * vec)
            c = flat[..., 0]
            for k in range(1, U * vec):
                c = c + flat[..., k]
    if tree == "fold_then_adjacent":
        while c.shape[1] > 32:
            h = c.shape[1] // 2
            c = c[:, :h] + c[:, h:]
        while c.shape[1] > 1:
            c = c[:, 0::2] + c[:, 1::2]
    elif tree == "halving":
        while c.shape[1] > 1:
            h = c.shape[1] // 2
            c = c[:, :h] + c[:, h:]
    else:
        while c.shape[1] > 1:
            c = c[:, 0::2] + c[:, 1::2]
    return c[:, 0]


def main():
    torch.manual_seed(0)
    shapes = [(1, 8), (64, 8), (40, 32), (3, 64), (1, 128), (8, 128), (48, 128), (1, 1024), (7, 1024), (64, 1024),
              (1, 5120), (2, 5120), (9, 5120), (333, 5120), (1, 6144), (64, 6144)]
    for R, n in shapes:
        x = torch.randn(R, n, device=DEV) * torch.rand(R, 1, device=DEV) * 4
        sq = x.pow(2)
        ref = sq.mean(dim=-1)
        s_ref = sq.sum(dim=-1)
        f = float(torch.tensor(1.0) / torch.tensor(float(n)))
        hits = []
        for vec, bw, mode, tree in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
                                                     ("A", "B", "C1", "C2"), ("fold_then_adjacent", "halving", "adjacent")):
            if vec * bw > 4 * n:
                continue
            s = emulate(sq, vec, bw, mode, tree)
            m_mul, m_div = bool(torch.equal(s * f, ref)), bool(torch.equal(s / n, ref))
            if m_mul or m_div or torch.equal(s, s_ref):
                hits.append(f"v{vec}/bw{bw}/{mode}/{tree}/{'mul' if m_mul else ''}{'div' if m_div else ''}"
                            f"{'/sum' if torch.equal(s, s_ref) else ''}")
        print(f"({R},{n}): {len(hits)} matches: {hits[:8]}", flush=True)


if __name__ == "__main__":
    main()
