//! The committed header is what cbindgen makes of the code now.

use std::path::Path;

#[test]
fn the_committed_header_is_current() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .expect("fairring-ffi/cbindgen.toml parses");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen reads the crate")
        .write(&mut generated);
    let path = crate_dir.join("include/fairring.h");
    if std::env::var_os("FAIRRING_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("writing include/fairring.h");
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/fairring.h is stale: regenerate it with \
         `FAIRRING_BLESS=1 cargo test -p fairring-ffi --test header` and commit it"
    );
}
