import sys, re, collections, subprocess, os, tempfile, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dsv4_sm80.kernels import w4a8_moe as k
fn = k._w4a8_moe_kernel
SIG = {
    "a_ptr": "*i8", "a_scale_ptr": "*fp32", "b_ptr": "*u8", "bs_ptr": "*u8", "c_ptr": "*i8", "c_scale_ptr": "*fp32",
    "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "topk_w_ptr": "*fp32",
    "N": "i32", "K": "i32", "num_pairs": "i32", "a_row_div": "i32", "a_scale_groups": "i32", "limit": "fp32",
    "stride_am": "i32", "stride_be": "i32", "stride_bn": "i32", "stride_bse": "i32", "stride_bsn": "i32",
    "stride_cm": "i32", "c_scale_groups": "i32"}
import inspect
params = inspect.signature(fn.fn).parameters
extra = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
cfg = dict(block_m=64, block_n=64, num_warps=8, num_stages=3, gated=True)
cfg.update(extra)
gated = cfg["gated"]
consts = {"GATED": gated, "MUL_WEIGHT": not gated, "A_GROUP": 0 if gated else cfg["block_n"], "BLOCK_M": cfg["block_m"],
          "BLOCK_N": cfg["block_n"], "SPAN": cfg.get("span", 32), "DECODE_ASM": True}
for k2, v in cfg.items():
    if k2.isupper(): consts[k2] = v
sig = dict(SIG, c_ptr="*i8" if gated else "*fp32")
for p in params:
    if p not in sig: sig[p] = "constexpr"
consts = {p: consts[p] for p in params if sig[p] == "constexpr" and p in consts}
names=list(params)
DIV16 = set(json.loads(os.environ.get("DIV16","null")) or ["a_ptr","a_scale_ptr","b_ptr","bs_ptr","c_ptr","c_scale_ptr","sorted_ids_ptr","block_expert_ptr","num_padded_ptr","topk_w_ptr","N","K","stride_am","stride_be","stride_bn","stride_bse","stride_bsn","stride_cm"])
attrs={(i,): [["tt.divisibility", 16]] for i,n in enumerate(names) if n in DIV16}
c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 80, 32),
                   options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
cubin = c.asm["cubin"]
d = tempfile.mkdtemp()
open(f"{d}/k.cubin", "wb").write(cubin)
nvd = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
sass = subprocess.run([nvd, "-c", "-g", f"{d}/k.cubin"], capture_output=True, text=True).stdout
open("/tmp/sass/last.sass", "w").write(sass)

all_lines = sass.splitlines()
labels = {}
for i, l in enumerate(all_lines):
    m = re.match(r"\s*(\.L_x_\d+):", l)
    if m: labels[m.group(1)] = i
def op(l):
    m = re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", l)
    return m.group(2) if m else None
print("shared", c.metadata.shared)
for i, l in enumerate(all_lines):
    m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", l)
    if m and labels.get(m.group(1), 1e9) < i:
        body = [op(x) for x in all_lines[labels[m.group(1)]:i + 1]]
        body = [b for b in body if b]
        cnt = collections.Counter(b.split(".")[0] for b in body)
        print(f"loop lines {labels[m.group(1)]}-{i}: {len(body)} instrs:", dict(cnt.most_common(40)))
