//! Instruction-by-instruction verification of generated code with iced-x86,
//! run on every buffer before its first call. Any failure names the kernel,
//! the offset, the bytes and the instruction.

use super::cpu::{CpuCaps, Isa};
use iced_x86::{
    CpuidFeature, Decoder, DecoderOptions, FlowControl, Formatter, Instruction,
    InstructionInfoFactory, IntelFormatter, Mnemonic, OpAccess, OpKind, Register,
};
use std::collections::HashSet;
use std::fmt;

/// Which check rejected the code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// Bytes do not decode (truncated or invalid encoding).
    Decode,
    /// Needs a CPUID feature the CPU or --max-isa does not allow.
    Cpuid,
    /// Mnemonic not on the allowlist (syscall, int, privileged, call, ...).
    Mnemonic,
    /// Indirect or far control transfer.
    IndirectBranch,
    /// Branch target outside the buffer or not on an instruction boundary.
    BranchTarget,
    /// An operand register or width differs from what kernels intend.
    Operand,
    /// Code can run past the end of the buffer.
    FallsOffEnd,
    /// Breaks the System V contract: writes a callee-saved register it did
    /// not push, moves rsp other than by push/pop, or returns without
    /// `vzeroupper`.
    Abi,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyError {
    pub kernel: String,
    pub check: Check,
    pub offset: usize,
    pub bytes: Vec<u8>,
    pub text: String,
    pub reason: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex: Vec<String> = self.bytes.iter().map(|b| format!("{b:02x}")).collect();
        write!(
            f,
            "verification of kernel {} failed ({:?} check) at offset {:#06x}: {}  [{}]: {}",
            self.kernel,
            self.check,
            self.offset,
            self.text,
            hex.join(" "),
            self.reason
        )
    }
}

impl std::error::Error for VerifyError {}

/// What a buffer is allowed to contain.
#[derive(Clone, Debug)]
pub struct Policy {
    pub features: HashSet<CpuidFeature>,
    /// Width in bits of the vectors the kernels intend (256 for AVX2).
    pub vector_bits: usize,
    pub isa: Isa,
}

impl Policy {
    /// The same features for a kernel of `bits`-wide vectors.
    pub fn with_vector_bits(&self, bits: usize) -> Policy {
        Policy {
            vector_bits: bits,
            ..self.clone()
        }
    }

    /// Features = detected CPU features, capped by `max_isa`.
    pub fn new(caps: &CpuCaps, max_isa: Isa) -> Policy {
        use CpuidFeature as F;
        let mut features: HashSet<CpuidFeature> = [
            F::INTEL8086,
            F::INTEL186,
            F::INTEL386,
            F::X64,
            F::CMOV,
            F::SSE,
            F::SSE2,
        ]
        .into_iter()
        .collect();
        let mut add = |ok: bool, f: F| {
            if ok {
                features.insert(f);
            }
        };
        add(caps.avx, F::AVX);
        add(caps.avx2, F::AVX2);
        add(caps.fma, F::FMA);
        add(caps.f16c, F::F16C);
        let wide = max_isa >= Isa::Avx512;
        add(wide && caps.avx512f, F::AVX512F);
        add(wide && caps.avx512bw, F::AVX512BW);
        add(wide && caps.avx512vl, F::AVX512VL);
        add(wide && caps.avx512_bf16, F::AVX512_BF16);
        add(wide && caps.avx512_vnni, F::AVX512_VNNI);
        let isa = caps.effective_isa(max_isa).unwrap_or(Isa::Avx2);
        Policy {
            features,
            vector_bits: 256,
            isa,
        }
    }
}

/// Everything kernels are expected to use. Anything else (syscall, int,
/// privileged or string ops, call, far jumps) is rejected.
const ALLOWED: &[Mnemonic] = {
    use Mnemonic::*;
    &[
        Push,
        Pop,
        Mov,
        Lea,
        Add,
        Sub,
        Imul,
        Xor,
        And,
        Shl,
        Shr,
        Inc,
        Dec,
        Cmp,
        Test,
        Cmovb,
        Cmovae,
        Ja,
        Jae,
        Jb,
        Jbe,
        Je,
        Jne,
        Jg,
        Jle,
        Jmp,
        Ret,
        Prefetcht0,
        Prefetcht1,
        Vzeroupper,
        Vmovd,
        Vmovq,
        Vmovss,
        Vmovups,
        Vmovaps,
        Vmaskmovps,
        Vbroadcastss,
        Vpbroadcastd,
        Vpmovsxbd,
        Vpmovzxbd,
        Vpmovzxwd,
        Vpcmpgtd,
        Vpslld,
        Vpaddd,
        Vpaddw,
        Vpaddb,
        Vcvtph2ps,
        Vcvtps2dq,
        Vroundps,
        Vextractf128,
        Vextractps,
        Vmovhlps,
        Vmovshdup,
        Vhaddps,
        Vaddps,
        Vaddss,
        Vsubps,
        Vmulps,
        Vmulss,
        Vdivps,
        Vdivss,
        Vsqrtss,
        Vmaxps,
        Vmaxss,
        Vminps,
        Vandps,
        Vxorps,
        Vblendvps,
        Vfmadd231ps,
        Vfmadd213ps,
        Vfnmadd231ps,
        // Integer dot products of 8-bit blocks (Q8_0 GEMV).
        Vmovdqu,
        Vpsignb,
        Vpabsb,
        Vpmaddubsw,
        Vpmaddwd,
        Vcvtdq2ps,
        Vinsertf128,
        Vphaddd,
        // Unpacking 5-bit values (Q5_0 GEMV) and their offset's correction.
        Vpsrlw,
        Vpsllw,
        Vinserti128,
        Vpsrld,
        Vbroadcasti128,
        // Unpacking into 16-row blocks: 4 rows x 8 chunks transposed.
        Vpunpckldq,
        Vpunpckhdq,
        Vpunpcklqdq,
        Vpunpckhqdq,
        Vpand,
        Vpor,
        Vpsrlvd,
        Vpshufd,
        Vpsubd,
        // Q5_0's row pairs: their high-bit word broadcast to 4 qword lanes
        // shifted by the lane's own count, rows split across halves.
        Vpbroadcastq,
        Vpmovzxbq,
        Vpsrlvq,
        Vpsllvq,
        Vperm2i128,
        // The integer GEMM over token tiles: weights broadcast to every
        // token's lane, 8-bit dot products, the 4 x 8 results transposed.
        Vpxor,
        Vextracti128,
        Vpbroadcastw,
        Vpdpbusd,
        Vunpcklps,
        Vunpckhps,
        Vshufps,
        Vunpcklpd,
        Vunpckhpd,
        Vperm2f128,
        // The integer GEMM on 512-bit vectors (VNNI): each row's chunks
        // over its 128-bit lane, 4 tokens' bytes broadcast to every lane,
        // the row scales spread and the results put in token order.
        Vmovdqu32,
        Vpinsrq,
        Vpxord,
        Vshufi64x2,
        Vbroadcasti32x4,
        Vbroadcastf32x4,
        Vpermps,
        // The GEMM over Q8_0x16: the rows of a partial block as an opmask
        // (1 << rows) - 1, the count clamped to 16 (with Cmovb).
        Kmovw,
        Bts,
        // The GEMM over Q5_0x16: each chunk's 64 high bits as an opmask
        // choosing 0x80 or 0x70, OR-ed onto the nibbles in one ternary op.
        Kmovq,
        Vpblendmb,
        Vpternlogd,
        // The GEMM over Q4_K, Q5_K and Q6_K in 16-row blocks: nibbles masked,
        // Q6_K's 2-bit fields rotated into place, Q5_K's fifth bits rotated
        // by the group's own count, Q4_K's and Q5_K's group sums times
        // their 6-bit scales in integers.
        Vpandd,
        Vprold,
        Vprord,
        Vprorvd,
        Vpmulld,
        // A pass of 8's Q6_K rotations in shifts and an OR (off the
        // ports of the products).
        Vpord,
        // The 16-bit GEMM on zmm: BF16 dot products, inputs broadcast to
        // both 256-bit halves, a row's halves added.
        Vdpbf16ps,
        Vbroadcastf64x4,
        Vshuff32x4,
        // The 16-bit GEMV on zmm: BF16 rows widened by interleaving with
        // zeros, the two 256-bit halves of its sums taken apart.
        Vpunpcklwd,
        Vpunpckhwd,
        Vextractf64x4,
        // BF16's ymm GEMV: the input's halves broadcast to both lanes.
        Vbroadcastf128,
    ]
};

/// Instructions whose destination must be a full-width vector register: the
/// xmm encoding of these would silently compute half of what was meant (the
/// dynasm `vbroadcastss ymm, [mem]` bug yields the xmm form).
const FULL_WIDTH_DEST: &[Mnemonic] = {
    use Mnemonic::*;
    &[
        Vbroadcastss,
        Vpbroadcastd,
        Vpbroadcastq,
        Vpmovzxbq,
        Vcvtph2ps,
        Vpmovzxwd,
        Vpmovsxbd,
        Vpmovzxbd,
        Vpcmpgtd,
        Vcvtps2dq,
        Vroundps,
    ]
};

/// Summary of a verified buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verified {
    pub instructions: usize,
    pub bytes: usize,
}

/// Decodes `code` (a kernel placed at offset 0) and applies every check.
pub fn verify(kernel: &str, code: &[u8], policy: &Policy) -> Result<Verified, VerifyError> {
    let mut decoder = Decoder::with_ip(64, code, 0, DecoderOptions::NONE);
    let mut instrs: Vec<Instruction> = Vec::new();
    let mut starts = HashSet::new();
    let mut instr = Instruction::default();
    let mut total = 0usize;
    let fail = |check: Check, ins: &Instruction, reason: String| -> VerifyError {
        let off = ins.ip() as usize;
        let end = (off + ins.len()).min(code.len());
        VerifyError {
            kernel: kernel.to_string(),
            check,
            offset: off,
            bytes: code[off.min(end)..end].to_vec(),
            text: format_instr(ins),
            reason,
        }
    };
    while decoder.can_decode() {
        decoder.decode_out(&mut instr);
        if instr.is_invalid() {
            let off = instr.ip() as usize;
            return Err(VerifyError {
                kernel: kernel.to_string(),
                check: Check::Decode,
                offset: off,
                bytes: code[off..(off + 15).min(code.len())].to_vec(),
                text: "(undecodable)".into(),
                reason: format!("{:?}", decoder.last_error()),
            });
        }
        starts.insert(instr.ip());
        total += instr.len();
        instrs.push(instr);
    }
    if total != code.len() {
        return Err(VerifyError {
            kernel: kernel.to_string(),
            check: Check::Decode,
            offset: total,
            bytes: code[total.min(code.len())..].to_vec(),
            text: "(trailing bytes)".into(),
            reason: format!(
                "instruction lengths sum to {total}, buffer is {}",
                code.len()
            ),
        });
    }
    for ins in &instrs {
        check_one(ins, policy, code.len() as u64, &starts).map_err(|(c, r)| fail(c, ins, r))?;
    }
    check_abi(&instrs).map_err(|(i, r)| fail(Check::Abi, &instrs[i], r))?;
    match instrs.last() {
        Some(last)
            if matches!(
                last.flow_control(),
                FlowControl::Return | FlowControl::UnconditionalBranch
            ) => {}
        Some(last) => {
            return Err(fail(
                Check::FallsOffEnd,
                last,
                "the last instruction is neither ret nor jmp".into(),
            ));
        }
        None => {
            return Err(VerifyError {
                kernel: kernel.to_string(),
                check: Check::Decode,
                offset: 0,
                bytes: Vec::new(),
                text: "(empty)".into(),
                reason: "empty buffer".into(),
            });
        }
    }
    Ok(Verified {
        instructions: instrs.len(),
        bytes: code.len(),
    })
}

fn check_one(
    ins: &Instruction,
    policy: &Policy,
    len: u64,
    starts: &HashSet<u64>,
) -> Result<(), (Check, String)> {
    match ins.flow_control() {
        FlowControl::IndirectBranch | FlowControl::IndirectCall => {
            return Err((Check::IndirectBranch, "indirect control transfer".into()));
        }
        FlowControl::ConditionalBranch | FlowControl::UnconditionalBranch => {
            let is_near = matches!(
                ins.op0_kind(),
                OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
            );
            if !is_near {
                return Err((Check::IndirectBranch, "far or non-relative branch".into()));
            }
            let t = ins.near_branch_target();
            if t >= len || !starts.contains(&t) {
                return Err((
                    Check::BranchTarget,
                    format!("branch target {t:#x} is outside the buffer or inside an instruction"),
                ));
            }
        }
        _ => {}
    }
    if !ALLOWED.contains(&ins.mnemonic()) {
        return Err((
            Check::Mnemonic,
            format!("mnemonic {:?} is not on the allowlist", ins.mnemonic()),
        ));
    }
    for f in ins.cpuid_features() {
        if !policy.features.contains(f) {
            return Err((
                Check::Cpuid,
                format!(
                    "needs CPUID feature {f:?}, not allowed by the CPU and --max-isa {}",
                    policy.isa.name()
                ),
            ));
        }
    }
    check_operands(ins, policy)
}

fn check_operands(ins: &Instruction, policy: &Policy) -> Result<(), (Check, String)> {
    let max_vec = policy.vector_bits / 8;
    for i in 0..ins.op_count() {
        match ins.op_kind(i) {
            OpKind::Register => {
                let r = ins.op_register(i);
                // Opmasks only in 512-bit kernels (partial stores).
                if r.is_k() && policy.vector_bits < 512 {
                    return Err((
                        Check::Operand,
                        format!("mask register {r:?} in a {}-bit kernel", policy.vector_bits),
                    ));
                }
                // Registers 16..31 exist only with EVEX, so only the
                // 512-bit kernels may name them.
                let high = r.number() >= 16 && policy.vector_bits < 512;
                if r.is_vector_register() && (r.size() > max_vec || high) {
                    return Err((
                        Check::Operand,
                        format!(
                            "register {r:?} is wider or higher than the {}-bit kernels use",
                            policy.vector_bits
                        ),
                    ));
                }
            }
            OpKind::Memory => {
                if ins.is_ip_rel_memory_operand() {
                    return Err((
                        Check::Operand,
                        "rip-relative memory: kernels carry no data".into(),
                    ));
                }
                for r in [ins.memory_base(), ins.memory_index()] {
                    if r != Register::None && !r.is_gpr64() && !r.is_vector_register() {
                        return Err((
                            Check::Operand,
                            format!("address register {r:?} is not 64-bit"),
                        ));
                    }
                }
            }
            _ => {}
        }
    }
    if FULL_WIDTH_DEST.contains(&ins.mnemonic())
        && ins.op_count() > 0
        && ins.op0_kind() == OpKind::Register
    {
        let r = ins.op0_register();
        // A 512-bit kernel also has full-width ymm steps.
        let full = r.size() * 8 == policy.vector_bits
            || (policy.vector_bits == 512 && r.size() * 8 == 256);
        if !full {
            return Err((
                Check::Operand,
                format!(
                    "destination {r:?} is {} bits; this instruction is only emitted at {} bits",
                    r.size() * 8,
                    policy.vector_bits
                ),
            ));
        }
    }
    Ok(())
}

const CALLEE_SAVED: [Register; 6] = [
    Register::RBX,
    Register::RBP,
    Register::R12,
    Register::R13,
    Register::R14,
    Register::R15,
];

/// System V checks over the whole kernel; returns the offending index.
fn check_abi(instrs: &[Instruction]) -> Result<(), (usize, String)> {
    // Registers saved by the leading run of pushes may be used freely.
    let saved: Vec<Register> = instrs
        .iter()
        .take_while(|i| i.mnemonic() == Mnemonic::Push)
        .filter(|i| i.op0_kind() == OpKind::Register)
        .map(|i| i.op0_register())
        .collect();
    let mut factory = InstructionInfoFactory::new();
    for (n, ins) in instrs.iter().enumerate() {
        if matches!(ins.mnemonic(), Mnemonic::Push | Mnemonic::Pop) {
            continue;
        }
        if ins.mnemonic() == Mnemonic::Ret
            && (n == 0 || instrs[n - 1].mnemonic() != Mnemonic::Vzeroupper)
        {
            return Err((n, "ret without vzeroupper before it".into()));
        }
        for used in factory.info(ins).used_registers() {
            let writes = matches!(
                used.access(),
                OpAccess::Write
                    | OpAccess::CondWrite
                    | OpAccess::ReadWrite
                    | OpAccess::ReadCondWrite
            );
            let reg = used.register().full_register();
            if !writes {
                continue;
            }
            if reg == Register::RSP && ins.mnemonic() != Mnemonic::Ret {
                return Err((n, "rsp changed other than by push/pop".into()));
            }
            if CALLEE_SAVED.contains(&reg) && !saved.contains(&reg) {
                return Err((
                    n,
                    format!("writes callee-saved {reg:?} without saving it first"),
                ));
            }
        }
    }
    Ok(())
}

/// Intel syntax for one instruction.
pub fn format_instr(ins: &Instruction) -> String {
    let mut f = IntelFormatter::new();
    f.options_mut().set_space_after_operand_separator(true);
    let mut s = String::new();
    f.format(ins, &mut s);
    s
}
