//! Planted bad bytes: each verifier check must fire on its own kind of bad
//! code, name the offset and show the instruction.

use dynasmrt::dynasm;
use iced_x86::code_asm::*;
use pulsar::jit::cpu::{CpuCaps, Isa};
use pulsar::jit::verify::{Check, Policy, verify};

fn policy(max: Isa) -> Policy {
    Policy::new(&CpuCaps::zen4_like(), max)
}

fn asm(f: impl FnOnce(&mut CodeAssembler) -> Result<(), IcedError>) -> Vec<u8> {
    let mut a = CodeAssembler::new(64).unwrap();
    f(&mut a).unwrap();
    a.assemble(0).unwrap()
}

fn expect(code: &[u8], max: Isa, check: Check, offset: usize) {
    let err = verify("planted", code, &policy(max)).expect_err("bad code must be rejected");
    assert_eq!(err.check, check, "{err}");
    assert_eq!(err.offset, offset, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("planted") && msg.contains(&format!("{offset:#06x}")),
        "{msg}"
    );
}

#[test]
fn good_code_passes() {
    let code = asm(|a| {
        a.vxorps(ymm0, ymm0, ymm0)?;
        a.vfmadd231ps(ymm0, ymm1, ymmword_ptr(rdi + rax * 2))?;
        a.vzeroupper()?;
        a.ret()
    });
    let v = verify("good", &code, &policy(Isa::Avx2)).unwrap();
    assert_eq!(v.instructions, 4);
    assert_eq!(v.bytes, code.len());
}

#[test]
fn syscall_is_rejected() {
    let code = asm(|a| {
        a.xor(eax, eax)?;
        a.syscall()?;
        a.ret()
    });
    expect(&code, Isa::Avx512, Check::Mnemonic, 2);
}

#[test]
fn int3_is_rejected() {
    let code = asm(|a| {
        a.int3()?;
        a.ret()
    });
    expect(&code, Isa::Avx512, Check::Mnemonic, 0);
}

#[test]
fn privileged_instruction_is_rejected() {
    let code = asm(|a| {
        a.cli()?;
        a.ret()
    });
    expect(&code, Isa::Avx512, Check::Mnemonic, 0);
}

#[test]
fn indirect_jump_is_rejected() {
    let code = asm(|a| {
        a.jmp(rax)?;
        a.ret()
    });
    expect(&code, Isa::Avx512, Check::IndirectBranch, 0);
    let code = asm(|a| {
        a.call(rax)?;
        a.ret()
    });
    expect(&code, Isa::Avx512, Check::IndirectBranch, 0);
}

#[test]
fn branch_outside_the_buffer_is_rejected() {
    // jmp rel32 +0x100, then ret: the target is past the end.
    let code = [0xe9, 0x00, 0x01, 0x00, 0x00, 0xc3];
    expect(&code, Isa::Avx512, Check::BranchTarget, 0);
    // Backwards before the start: jne -0x20.
    let code = [0x75, 0xe0, 0xc3];
    expect(&code, Isa::Avx512, Check::BranchTarget, 0);
}

#[test]
fn branch_into_the_middle_of_an_instruction_is_rejected() {
    // 0: mov eax, 0x90909090 (5 bytes); 5: jne 1 (into the immediate); 7: ret
    let code = [0xb8, 0x90, 0x90, 0x90, 0x90, 0x75, 0xfa, 0xc3];
    expect(&code, Isa::Avx512, Check::BranchTarget, 5);
}

#[test]
fn avx512_under_avx2_max_isa_is_rejected() {
    let code = asm(|a| {
        a.vaddps(zmm0, zmm1, zmm2)?;
        a.ret()
    });
    expect(&code, Isa::Avx2, Check::Cpuid, 0);
    // The same bytes are acceptable to the CPUID check when AVX-512 is allowed
    // on a CPU that has it; the 256-bit width rule still rejects zmm.
    let err = verify("planted", &code, &policy(Isa::Avx512)).unwrap_err();
    assert_eq!(err.check, Check::Operand, "{err}");
    // A kernel planned at 512 bits (the VNNI integer GEMM) may use zmm0..31,
    // and its full-width steps may be ymm, but not xmm; a 256-bit kernel
    // may not name ymm16..31 (EVEX only).
    let wide = policy(Isa::Avx512).with_vector_bits(512);
    let ok = asm(|a| {
        a.vaddps(zmm0, zmm1, zmm2)?;
        a.vsubps(zmm3, zmm3, zmm16)?;
        a.vbroadcastss(ymm3, dword_ptr(rdi))?;
        a.vzeroupper()?;
        a.ret()
    });
    verify("wide", &ok, &wide).unwrap();
    let narrow_dest = asm(|a| {
        a.vbroadcastss(xmm3, dword_ptr(rdi))?;
        a.ret()
    });
    assert_eq!(
        verify("wide", &narrow_dest, &wide).unwrap_err().check,
        Check::Operand
    );
    let high = asm(|a| {
        // ymm16 has no VEX form.
        a.set_prefer_vex(false);
        a.vaddps(ymm16, ymm1, ymm2)?;
        a.ret()
    });
    assert_eq!(
        verify("narrow", &high, &policy(Isa::Avx512))
            .unwrap_err()
            .check,
        Check::Operand
    );
}

#[test]
fn avx512_on_a_cpu_without_it_is_rejected() {
    let caps = CpuCaps {
        avx512f: false,
        avx512bw: false,
        avx512vl: false,
        ..CpuCaps::zen4_like()
    };
    let code = asm(|a| {
        a.vaddps(ymm0, ymm1, ymm2)?;
        a.vaddps(zmm0, zmm1, zmm2)?;
        a.ret()
    });
    let err = verify("planted", &code, &Policy::new(&caps, Isa::Avx512)).unwrap_err();
    assert_eq!((err.check, err.offset), (Check::Cpuid, 4), "{err}");
}

#[test]
fn dynasm_vbroadcastss_memory_bug_is_caught() {
    // dynasm-rs 5.1 encodes this as the xmm form; the width rule must notice.
    let mut ops = dynasmrt::VecAssembler::<dynasmrt::x64::X64Relocation>::new(0);
    dynasm!(ops
        ; .arch x64
        ; vbroadcastss ymm0, [rdi]
        ; ret
    );
    let code = ops.finalize().unwrap();
    let err = verify("planted", &code, &policy(Isa::Avx2)).unwrap_err();
    assert_eq!((err.check, err.offset), (Check::Operand, 0), "{err}");
    assert!(err.text.contains("xmm0"), "{err}");
    // The register-source form that kernels use is accepted.
    let mut ops = dynasmrt::VecAssembler::<dynasmrt::x64::X64Relocation>::new(0);
    dynasm!(ops
        ; .arch x64
        ; vbroadcastss ymm0, xmm0
        ; vzeroupper
        ; ret
    );
    verify("good", &ops.finalize().unwrap(), &policy(Isa::Avx2)).unwrap();
}

#[test]
fn xmm_form_vbroadcastss_from_iced_is_caught() {
    let code = asm(|a| {
        a.vxorps(ymm1, ymm1, ymm1)?;
        a.vbroadcastss(xmm0, dword_ptr(rdi))?;
        a.ret()
    });
    expect(&code, Isa::Avx2, Check::Operand, 4);
}

#[test]
fn truncated_instruction_is_rejected() {
    let code = asm(|a| {
        a.vxorps(ymm0, ymm0, ymm0)?;
        a.vfmadd231ps(ymm0, ymm1, ymmword_ptr(rdi + 0x100))?;
        a.ret()
    });
    // Cut inside the FMA's displacement (drop the ret and one more byte).
    let cut = &code[..code.len() - 2];
    let err = verify("planted", cut, &policy(Isa::Avx2)).unwrap_err();
    assert_eq!(err.check, Check::Decode, "{err}");
    assert_eq!(err.offset, 4, "{err}");
}

#[test]
fn code_falling_off_the_end_is_rejected() {
    let code = asm(|a| a.vxorps(ymm0, ymm0, ymm0));
    expect(&code, Isa::Avx2, Check::FallsOffEnd, 0);
}

#[test]
fn rip_relative_and_32bit_addresses_are_rejected() {
    // vmovups ymm0, [rip+0]; ret
    let code = [0xc5, 0xfc, 0x10, 0x05, 0, 0, 0, 0, 0xc3];
    expect(&code, Isa::Avx2, Check::Operand, 0);
    let code = asm(|a| {
        a.vmovups(ymm0, ymmword_ptr(edi))?;
        a.ret()
    });
    expect(&code, Isa::Avx2, Check::Operand, 0);
}

#[test]
fn every_planned_kernel_verifies() {
    use pulsar::jit::dims::ModelDims;
    use pulsar::jit::kernels::emit_and_verify;
    use pulsar::jit::plan::{PlanOptions, plan};
    let caps = CpuCaps::zen4_like();
    for max in [Isa::Avx2, Isa::Avx512] {
        let opts = PlanOptions {
            max_isa: max,
            ..PlanOptions::default()
        };
        let p = plan(&ModelDims::GEMMA3_270M, &caps, &opts).unwrap();
        let e = emit_and_verify(&p, &caps, max).unwrap();
        assert_eq!(e.kernels.len(), p.kernels.len());
        assert!(e.kernels.iter().all(|k| k.verified.bytes == k.code.len()));
    }
}

#[test]
fn unsaved_callee_saved_register_is_rejected() {
    let code = asm(|a| {
        a.mov(rbx, 1u64)?;
        a.vzeroupper()?;
        a.ret()
    });
    expect(&code, Isa::Avx2, Check::Abi, 0);
    // Saved first: accepted.
    let code = asm(|a| {
        a.push(rbx)?;
        a.mov(rbx, 1u64)?;
        a.pop(rbx)?;
        a.vzeroupper()?;
        a.ret()
    });
    verify("good", &code, &policy(Isa::Avx2)).unwrap();
}

#[test]
fn stack_pointer_arithmetic_is_rejected() {
    let code = asm(|a| {
        a.sub(rsp, 8)?;
        a.vzeroupper()?;
        a.ret()
    });
    expect(&code, Isa::Avx2, Check::Abi, 0);
}

#[test]
fn ret_without_vzeroupper_is_rejected() {
    let code = asm(|a| {
        a.vxorps(ymm0, ymm0, ymm0)?;
        a.ret()
    });
    expect(&code, Isa::Avx2, Check::Abi, 4);
}
