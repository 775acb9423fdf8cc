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
    // sm_90a: what H100 and H200 get (the warpgroup-MMA kernels); sm_90 for the rest of Hopper's
    // line without them.
    for arch in ["sm_90a", "sm_90", "sm_80"] {
        let images = cuda::compile_kernels(arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(images.len(), cuda::KERNEL_GROUPS, "{arch}: one image per kernel group");
        for (group, cubin) in images.iter().enumerate() {
            // scripts/dev/sass_loops.sh reads the images (spills inside loops, per kernel).
            if let Some(dir) = std::env::var_os("TANDEM_DUMP_CUBIN") {
                std::fs::write(std::path::Path::new(&dir).join(format!("kernels_{arch}_g{group}.cubin")), cubin)
                    .unwrap();
            }
            // ELF images, together naming every kernel the loader will ask for, each once.
            assert_eq!(&cubin[..4], b"\x7fELF", "{arch} group {group}: not a CUBIN");
        }
        for name in cuda::KERNEL_NAMES {
            // The loader asks only the image that defines the kernel (cuda::image_defines).
            let holders = images.iter().filter(|c| cuda::image_defines(c, name)).count();
            assert_eq!(holders, 1, "{arch}: kernel `{name}` is in {holders} images, not one");
        }
    }
}
