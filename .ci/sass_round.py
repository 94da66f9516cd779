"""What one lane of the CUDA 8-bit kernel issues in one round (8 elements), counted from its SASS without a GPU: the
walk starts at the round loop's head and stops at its back edge; a conditional branch whose next few instructions
call a slow path (a divide's, a square root's) is taken, any other falls through (a block in range, an active warp),
an unconditional one is followed; a predicated instruction counts whether or not it runs (it is issued). The README's
figures for the 8-bit kernel come from it. nvdisasm is not in every CUDA toolkit; its wheel has it:

    pip download --no-deps nvidia-cuda-nvdisasm && unzip -o nvidia_cuda_nvdisasm-*.whl -d /tmp/nvdisasm
    nvcc -O3 --fmad=false -cubin -arch=sm_90 -Icsrc csrc/adamw.cu -o /tmp/adamw.cubin
    /tmp/nvdisasm/nvidia/cu13/bin/nvdisasm -c /tmp/adamw.cubin > /tmp/adamw.sass
    python .ci/sass_round.py /tmp/adamw.sass _Z18adamw_block_kernelIf10Fp32MasterI4bf16ELb1EEv9AdamWArgs
"""
import re
import sys

text, name = open(sys.argv[1]).read(), sys.argv[2]  # the kernel's mangled name: fp32 grads, bf16 param, vector loads
lines = text.split(f".text.{name}:")[1].split("\n.text.")[0].splitlines()
instrs, labels = [], {}  # the instructions in order; each label's index among them
for line in lines:
    if m := re.match(r"^(\.L_x_\d+):", line):
        labels[m.group(1)] = len(instrs)
    elif m := re.match(r"^\s*/\*[0-9a-f]{4}\*/\s+(.*?);", line):
        instrs.append(m.group(1).strip())
target = lambda i: labels[re.search(r"\((\.L_x_\d+)\)", instrs[i]).group(1)]
conditional = lambda i: re.match(r"@!?P\d BRA", instrs[i]) is not None
# the round loop's back edge: the last conditional branch backwards before the block's vote (BAR.RED)
vote = next(i for i, s in enumerate(instrs) if s.startswith("BAR.RED"))
back = max(i for i in range(vote) if conditional(i) and target(i) < i)
i, issued, ops = target(back), 0, {}
while i != back:
    issued += 1
    op = re.sub(r"^@!?U?P\w+\s+", "", instrs[i]).split()[0].split(".")[0]
    ops[op] = ops.get(op, 0) + 1
    if "BRA" in op:
        following = instrs[i + 1:min([p for p in labels.values() if p > i] + [i + 7])]
        if not conditional(i) or any("CALL" in f for f in following):
            i = target(i)
            continue
    i += 1
print(f"{name}: {issued} instructions a round (8 elements a lane), {issued / 8:.1f} an element")
print("  ", ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])))
