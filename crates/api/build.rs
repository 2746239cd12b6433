fn main() {
    // The console's files are embedded by `rust-embed`; a file added to or removed from the
    // directory must rebuild the crate too, not only a changed one.
    println!("cargo:rerun-if-changed=console");
}
