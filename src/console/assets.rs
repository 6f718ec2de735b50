//! The console's page, built from `console/` (TypeScript, bundled with
//! esbuild) and embedded in the binary: serving it needs no npm. The test
//! command rebuilds `console/dist/` and fails when it drifts. For work on
//! the page itself, `[console] assets_dir` serves a folder instead (read
//! once, at start).

use bytes::Bytes;

/// One file the console serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Asset {
    pub path: &'static str,
    pub content_type: &'static str,
    pub bytes: Bytes,
}

/// Most bytes of one file read from `assets_dir`.
pub const MAX_ASSET_BYTES: u64 = 16 * 1024 * 1024;

/// (URL path, file in `console/dist/`, content type, embedded bytes).
const FILES: &[(&str, &str, &str, &[u8])] = &[
    (
        "/",
        "index.html",
        "text/html; charset=utf-8",
        include_bytes!("../../console/dist/index.html"),
    ),
    (
        "/index.html",
        "index.html",
        "text/html; charset=utf-8",
        include_bytes!("../../console/dist/index.html"),
    ),
    (
        "/console.js",
        "console.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../console/dist/console.js"),
    ),
    (
        "/console.css",
        "console.css",
        "text/css; charset=utf-8",
        include_bytes!("../../console/dist/console.css"),
    ),
];

/// The files to serve: the embedded ones, or those of `dir`.
pub fn load(dir: Option<&std::path::Path>) -> std::io::Result<Vec<Asset>> {
    use std::io::Read;
    FILES
        .iter()
        .map(|(path, file, content_type, embedded)| {
            let bytes = match dir {
                None => Bytes::from_static(embedded),
                Some(dir) => {
                    let mut bytes = Vec::new();
                    std::fs::File::open(dir.join(file))?
                        .take(MAX_ASSET_BYTES + 1)
                        .read_to_end(&mut bytes)?;
                    if bytes.len() as u64 > MAX_ASSET_BYTES {
                        return Err(std::io::Error::other(format!(
                            "{file} is larger than {MAX_ASSET_BYTES} bytes"
                        )));
                    }
                    Bytes::from(bytes)
                }
            };
            Ok(Asset {
                path,
                content_type,
                bytes,
            })
        })
        .collect()
}
