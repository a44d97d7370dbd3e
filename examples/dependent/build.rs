//! Put LibTorch's `lib/` folder on this binary's rpath, so it starts without
//! `LD_LIBRARY_PATH`: phaselens's build script found the folder and passes it on as
//! `DEP_PHASELENS_LIBTORCH_LIB` (only with its `tch` feature). Cargo applies a
//! dependency's link arguments to the dependency alone, hence these lines here.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_PHASELENS_LIBTORCH_LIB");
    if let Some(dir) = std::env::var_os("DEP_PHASELENS_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.to_string_lossy());
    }
}
