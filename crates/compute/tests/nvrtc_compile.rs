//! Every CUDA kernel compiles with NVRTC, for the archs tandem targets. Needs only libnvrtc
//! (CI installs the PyPI `nvidia-cuda-nvrtc` wheel), not a GPU.
//!
//! Without libnvrtc the test is skipped, unless `TANDEM_REQUIRE_NVRTC=1` (set by `.ci/run`),
//! which turns a missing compiler into a failure so CI cannot pass by skipping.

use tandem_compute::cuda;

#[test]
fn every_kernel_compiles_for_hopper_and_ampere() {
    if !cuda::nvrtc_present() {
        assert!(
            std::env::var("TANDEM_REQUIRE_NVRTC").map_or(true, |v| v != "1"),
            "TANDEM_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
        );
        eprintln!("libnvrtc not found; skipping the kernel compile check");
        return;
    }
    for arch in ["sm_90", "sm_80"] {
        let cubin = cuda::compile_kernels(arch).unwrap_or_else(|e| panic!("{e}"));
        // scripts/dev/sass_loops.sh reads the image (spills inside loops, per kernel).
        if let Some(dir) = std::env::var_os("TANDEM_DUMP_CUBIN") {
            std::fs::write(std::path::Path::new(&dir).join(format!("kernels_{arch}.cubin")), &cubin).unwrap();
        }
        // An ELF image that names every kernel the loader will ask for.
        assert_eq!(&cubin[..4], b"\x7fELF", "{arch}: not a CUBIN");
        let text = String::from_utf8_lossy(&cubin);
        for name in cuda::KERNEL_NAMES {
            assert!(text.contains(name), "{arch}: kernel `{name}` missing from the image");
        }
    }
    // The measurement builds kernels.cu knows (TANDEM_KERNEL_DEFINES) compile too, to other code.
    let plain = cuda::compile_kernels_with("sm_90", &[]).unwrap_or_else(|e| panic!("{e}"));
    for define in ["TANDEM_STREAM_EVICT_FIRST"] {
        for arch in ["sm_90", "sm_80"] {
            let cubin = cuda::compile_kernels_with(arch, &[define.to_string()]).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(&cubin[..4], b"\x7fELF", "{arch} with {define}: not a CUBIN");
            if arch == "sm_90" {
                assert!(cubin != plain, "{define} changes nothing");
            }
        }
    }
}
