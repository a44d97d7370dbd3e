# Exploration only (not product code, not used by tests): a PyTorch replica of
# phaselens' kvc full-attention organism (pre-norm, RoPE, qk_norm, sink, GQA, SwiGLU) and
# its KV-retrieval training sampler (24 single-token bindings, 16 queried, 0-7 prefix
# pads, loss on the queried values), used to scan recipes faster than a full Rust build.
# It is what showed that pure full attention stays at the copy baseline even with 4
# bindings and that a one-token key shift (--shift 1) removes the plateau; see
# experiments/organisms/full-attn.toml. Needs torch (tested with 2.9.0, CPU).
#   python scripts/explore/fa_replica.py --nb 4 --nq 4 --steps 3000        # plateau
#   python scripts/explore/fa_replica.py --shift 1 --steps 1000            # learns
import argparse, math, time, torch, torch.nn as nn, torch.nn.functional as F
p = argparse.ArgumentParser()
p.add_argument('--layers', type=int, default=2); p.add_argument('--d', type=int, default=128)
p.add_argument('--heads', type=int, default=4); p.add_argument('--kv', type=int, default=1)
p.add_argument('--dff', type=int, default=256); p.add_argument('--qknorm', type=int, default=1)
p.add_argument('--sink', type=int, default=1); p.add_argument('--lr', type=float, default=3e-3)
p.add_argument('--steps', type=int, default=3000); p.add_argument('--bs', type=int, default=32)
p.add_argument('--nb', type=int, default=24); p.add_argument('--nq', type=int, default=16)
p.add_argument('--cur0', type=int, default=0); p.add_argument('--cursteps', type=int, default=0)
p.add_argument('--wd', type=float, default=0.01); p.add_argument('--warm', type=int, default=100)
p.add_argument('--theta', type=float, default=1e4); p.add_argument('--seed', type=int, default=0)
p.add_argument('--rope', type=int, default=1); p.add_argument('--std', type=float, default=0.02)
p.add_argument('--abspos', type=int, default=0); p.add_argument('--shift', type=int, default=0); p.add_argument('--attnonly', type=int, default=0); p.add_argument('--task', default='kv'); p.add_argument('--every', type=int, default=250); p.add_argument('--beta2', type=float, default=0.99)
a = p.parse_args()
torch.manual_seed(a.seed); torch.set_num_threads(1)
P = 8; T = 1 + a.nb * 2 + 1 + a.nq * 2 + P - 1
def batch(step):
    if a.task == 'rep': return rep_batch(step)
    g = torch.Generator().manual_seed(a.seed * 1000003 + step)
    nb = a.nb
    if a.cursteps:
        nb = a.cur0 + (a.nb - a.cur0) * min(step, a.cursteps) // a.cursteps
    nq = min(a.nq, nb); B = a.bs
    lead = torch.randint(0, P, (B,), generator=g)
    keys = torch.rand(B, 48, generator=g).argsort(1)[:, :nb] + 16
    vals = torch.randint(64, 128, (B, nb), generator=g)
    qs = torch.rand(B, nb, generator=g).argsort(1)[:, :nq]
    qk = keys.gather(1, qs); qv = vals.gather(1, qs)
    body = torch.cat([torch.ones(B, 1, dtype=torch.long), torch.stack([keys, vals], 2).flatten(1),
                      torch.full((B, 1), 3), torch.stack([qk, qv], 2).flatten(1)], 1)
    L = body.shape[1]
    X = torch.zeros(B, T, dtype=torch.long); Y = torch.full((B, T), -100)
    idx = lead[:, None] + torch.arange(L)[None]
    X.scatter_(1, idx, body)
    ypos = lead[:, None] + 1 + 2 * nb + 1 + 2 * torch.arange(nq)[None]
    Y.scatter_(1, ypos, qv)
    return X, Y
def rep_batch(step):
    g = torch.Generator().manual_seed(a.seed * 1000003 + step)
    n = a.nb; x = torch.randint(16, 128, (a.bs, n), generator=g)
    X = torch.cat([torch.ones(a.bs, 1, dtype=torch.long), x, x], 1)
    Y = torch.full_like(X, -100); Y[:, n + 1:-1] = X[:, n + 2:]
    return X, Y
class RMS(nn.Module):
    def __init__(s, d): super().__init__(); s.w = nn.Parameter(torch.ones(d))
    def forward(s, x): return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * s.w
def rope(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)
class Attn(nn.Module):
    def __init__(s):
        super().__init__(); s.dh = a.d // a.heads
        s.q = nn.Linear(a.d, a.heads * s.dh, bias=False); s.k = nn.Linear(a.d, a.kv * s.dh, bias=False)
        s.v = nn.Linear(a.d, a.kv * s.dh, bias=False); s.o = nn.Linear(a.heads * s.dh, a.d, bias=False)
        s.mu = nn.Parameter(torch.full((a.d,), 0.5)); s.qn = RMS(s.dh); s.kn = RMS(s.dh); s.sink = nn.Parameter(torch.zeros(a.heads))
    def forward(s, x, cos, sin, mask):
        B, T, _ = x.shape
        q = s.q(x).view(B, T, a.heads, s.dh).transpose(1, 2)
        xk = x
        if a.shift:
            xp = F.pad(x, (0, 0, 1, 0))[:, :-1]; xk = s.mu * x + (1 - s.mu) * xp
        k = s.k(xk).view(B, T, a.kv, s.dh).transpose(1, 2)
        v = s.v(x).view(B, T, a.kv, s.dh).transpose(1, 2)
        if a.qknorm: q, k = s.qn(q), s.kn(k)
        if a.rope: q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = a.heads // a.kv
        k = k.repeat_interleave(rep, 1); v = v.repeat_interleave(rep, 1)
        sc = q @ k.transpose(-1, -2) / math.sqrt(s.dh)
        sc = sc.masked_fill(~mask, float('-inf'))
        if a.sink:
            sk = s.sink.view(1, -1, 1, 1).expand(B, -1, T, 1)
            w = torch.softmax(torch.cat([sc, sk], -1), -1)[..., :T]
        else:
            w = torch.softmax(sc, -1)
        return s.o((w @ v).transpose(1, 2).reshape(B, T, -1))
class Block(nn.Module):
    def __init__(s):
        super().__init__(); s.n1 = RMS(a.d); s.n2 = RMS(a.d); s.at = Attn()
        s.g = nn.Linear(a.d, a.dff, bias=False); s.u = nn.Linear(a.d, a.dff, bias=False); s.dn = nn.Linear(a.dff, a.d, bias=False)
    def forward(s, x, cos, sin, mask):
        x = x + s.at(s.n1(x), cos, sin, mask)
        if a.attnonly: return x
        h = s.n2(x); return x + s.dn(F.silu(s.g(h)) * s.u(h))
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.e = nn.Embedding(128, a.d); s.bl = nn.ModuleList([Block() for _ in range(a.layers)])
        s.pe = nn.Embedding(T, a.d) if a.abspos else None; s.n = RMS(a.d); s.h = nn.Linear(a.d, 128, bias=False)
        for n, p_ in s.named_parameters():
            if p_.dim() == 2: nn.init.normal_(p_, std=a.std)
    def forward(s, x):
        T = x.shape[1]; dh = a.d // a.heads
        inv = 1.0 / (a.theta ** (torch.arange(0, dh, 2).float() / dh))
        ang = torch.arange(T).float()[:, None] * inv[None]
        cos, sin = ang.cos(), ang.sin()
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        h = s.e(x)
        if s.pe is not None: h = h + s.pe.weight[None, :T]
        for b in s.bl: h = b(h, cos, sin, mask)
        return s.h(s.n(h))
m = M()
opt = torch.optim.AdamW(m.parameters(), lr=a.lr, betas=(0.9, a.beta2), eps=1e-8, weight_decay=a.wd)
def lr_at(s):
    if s < a.warm: return a.lr * (s + 1) / a.warm
    pr = (s - a.warm) / max(1, a.steps - a.warm)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * pr)))
t0 = time.time(); accs = []; losses = []
for step in range(a.steps):
    for gr in opt.param_groups: gr['lr'] = lr_at(step)
    X, Y = batch(step); lg = m(X)
    loss = F.cross_entropy(lg.view(-1, 128), Y.view(-1), ignore_index=-100)
    opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step()
    with torch.no_grad():
        sel = Y != -100; accs.append((lg.argmax(-1)[sel] == Y[sel]).float().mean().item()); losses.append(loss.item())
    if (step + 1) % a.every == 0:
        print(f"step {step+1} loss {sum(losses)/len(losses):.3f} acc {sum(accs)/len(accs):.3f} t {time.time()-t0:.0f}s", flush=True)
        accs = []; losses = []
