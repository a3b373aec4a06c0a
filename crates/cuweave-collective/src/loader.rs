//! Finding NCCL, opening it once and resolving its entry points.
//!
//! [`nccl()`] searches for the library the first time it is called ([`LibrarySearch`]), opens
//! the first candidate that loads, resolves every entry point cuweave uses into an [`NcclApi`]
//! table, reads `ncclGetVersion`, and caches the outcome in a `OnceLock`. No NCCL is
//! `Err(CollectiveError::NotFound { tried, .. })`, never a panic. The driver's loader
//! (`cuweave_driver::loader`) has the same shape; the symbol choice ([`choose_entry_point`]), the
//! function-type helper ([`OptionalFn`]) and the resolving of an entry point
//! ([`Entry::resolve_as`](cuweave_driver::loader::Entry::resolve_as)) are the driver's.

use std::ffi::{CStr, OsString, c_void};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::OnceLock;

pub use cuweave_driver::loader::{OptionalFn, SymbolLookup, choose_entry_point};

use crate::error::{CollectiveError, NcclCode, Result};
use crate::sys;

/// The environment variable naming the NCCL library to load. When set, it is the only
/// candidate: a wrong path is an error, never a silent fallback to another NCCL.
pub const NCCL_PATH_VAR: &str = "CUWEAVE_NCCL_PATH";

/// The library names `dlopen` is asked for, in order, after [`NCCL_PATH_VAR`].
pub const LIBRARY_NAMES: &[&str] = &["libnccl.so.2", "libnccl.so"];

/// Where the `nvidia-nccl-cu13` (or `-cu12`) wheel puts the library inside a site-packages folder.
pub const WHEEL_LIBRARY: &str = "nvidia/nccl/lib/libnccl.so.2";

/// The ordered list of libraries to try, built from the environment without running Python.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibrarySearch {
    /// Candidates in order: a path, or a bare name for the dynamic loader's own search.
    pub candidates: Vec<OsString>,
    /// Site-packages folders looked in for the wheel (whether or not they held it).
    pub site_packages: Vec<PathBuf>,
}

impl LibrarySearch {
    /// The search for this process: [`NCCL_PATH_VAR`] alone when set; otherwise
    /// [`LIBRARY_NAMES`], then [`WHEEL_LIBRARY`] in every site-packages folder found.
    pub fn from_env() -> Self {
        Self::with_env(|name| std::env::var_os(name))
    }

    /// [`from_env`](Self::from_env) with the environment given as a function (for tests).
    ///
    /// Site-packages folders are looked for, in order, in each `PYTHONPATH` entry, then under
    /// `$VIRTUAL_ENV`, `$CONDA_PREFIX`, `~/.local`, every `$PYENV_ROOT/versions/*` (default
    /// `~/.pyenv`), `/usr/local` and `/usr`: their `lib/python3*/site-packages` and
    /// `lib/python3*/dist-packages`, plus `/usr/lib/python3/dist-packages` (Debian's).
    pub fn with_env(env: impl Fn(&str) -> Option<OsString>) -> Self {
        if let Some(path) = env(NCCL_PATH_VAR).filter(|path| !path.is_empty()) {
            return Self {
                candidates: vec![path],
                site_packages: Vec::new(),
            };
        }
        let mut candidates: Vec<OsString> = LIBRARY_NAMES.iter().map(OsString::from).collect();
        let site_packages = site_packages(&env);
        for folder in &site_packages {
            let library = folder.join(WHEEL_LIBRARY);
            if library.is_file() {
                candidates.push(library.into_os_string());
            }
        }
        Self {
            candidates,
            site_packages,
        }
    }

    /// What [`CollectiveError::NotFound`] lists as tried.
    fn tried(&self) -> Vec<String> {
        let mut tried: Vec<String> = self
            .candidates
            .iter()
            .map(|c| c.to_string_lossy().into_owned())
            .collect();
        let held = |folder: &PathBuf| folder.join(WHEEL_LIBRARY).is_file();
        let empty = self.site_packages.iter().filter(|f| !held(f)).count();
        if empty > 0 {
            tried.push(format!(
                "{WHEEL_LIBRARY} in {empty} site-packages folder(s) without it"
            ));
        }
        tried
    }
}

fn site_packages(env: &impl Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let mut folders = Vec::new();
    if let Some(path) = env("PYTHONPATH") {
        folders.extend(std::env::split_paths(&path).filter(|p| p.is_dir()));
    }
    let home = env("HOME").map(PathBuf::from);
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = env(var) {
            prefixes.push(PathBuf::from(prefix));
        }
    }
    if let Some(home) = &home {
        prefixes.push(home.join(".local"));
    }
    let pyenv = env("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| home.as_ref().map(|h| h.join(".pyenv")));
    if let Some(pyenv) = pyenv {
        prefixes.extend(sorted_children(&pyenv.join("versions"), |_| true));
    }
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));
    for prefix in prefixes {
        for python in sorted_children(&prefix.join("lib"), |name| name.starts_with("python3")) {
            for kind in ["site-packages", "dist-packages"] {
                let folder = python.join(kind);
                if folder.is_dir() {
                    folders.push(folder);
                }
            }
        }
    }
    folders.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    folders.retain(|f| f.is_dir());
    let mut seen = std::collections::HashSet::new();
    folders.retain(|f| seen.insert(f.clone()));
    folders
}

/// The sub-folders of `dir` whose names pass `keep`, newest-looking (highest name) first.
fn sorted_children(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut children: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.file_name().to_str().is_some_and(&keep))
        .map(|entry| entry.path())
        .filter(|path| path.is_dir())
        .collect();
    children.sort();
    children.reverse();
    children
}

/// One resolved entry point: the symbol and the function, if the library exports it (the
/// driver's [`Entry`](cuweave_driver::loader::Entry), whose absence is this crate's error).
#[derive(Clone, Copy)]
pub struct Entry<F>(cuweave_driver::loader::Entry<F>);

impl<F: Copy> Entry<F> {
    fn resolve(candidates: &[&'static str], lookup: &mut SymbolLookup<'_>) -> Self {
        // SAFETY: `F` is the `PFN_<symbol>` typedef that `bindgen-nccl` derived from `nccl.h`'s
        // declaration of exactly this symbol (`__typeof__`; the `nccl_table!` rows pair them).
        Self(unsafe { cuweave_driver::loader::Entry::resolve_as(candidates, lookup) })
    }

    /// The function, or `Unsupported` naming the symbol when the library lacks it.
    pub fn get(&self) -> Result<F> {
        self.0.function().ok_or(CollectiveError::Unsupported {
            symbol: self.0.symbol(),
        })
    }

    /// The symbol this entry was resolved as.
    pub fn symbol(&self) -> &'static str {
        self.0.symbol()
    }

    /// Whether the library exports this entry point.
    pub fn is_available(&self) -> bool {
        self.0.is_available()
    }
}

impl<F> std::fmt::Debug for Entry<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.0, f)
    }
}

macro_rules! nccl_table {
    ($( $field:ident : $pfn:ident = $symbol:literal ),* $(,)?) => {
        /// Every NCCL entry point cuweave uses, resolved once by name.
        #[non_exhaustive]
        pub struct NcclApi {
            $( #[doc = concat!("`", $symbol, "`")] pub $field: Entry<<sys::$pfn as OptionalFn>::Fn>, )*
        }

        impl NcclApi {
            /// Builds the table from a symbol-lookup function (the loaded library's, or a test's).
            pub fn resolve(lookup: &mut SymbolLookup<'_>) -> Self {
                Self { $( $field: Entry::resolve(&[$symbol], lookup), )* }
            }

            /// Every entry point, as (symbol, available), for diagnostics.
            pub fn entry_points(&self) -> Vec<(&'static str, bool)> {
                vec![$( (self.$field.symbol(), self.$field.is_available()), )*]
            }
        }
    };
}

nccl_table! {
    get_version: PFN_ncclGetVersion = "ncclGetVersion",
    get_unique_id: PFN_ncclGetUniqueId = "ncclGetUniqueId",
    get_error_string: PFN_ncclGetErrorString = "ncclGetErrorString",
    get_last_error: PFN_ncclGetLastError = "ncclGetLastError",
    comm_init_all: PFN_ncclCommInitAll = "ncclCommInitAll",
    comm_init_rank: PFN_ncclCommInitRank = "ncclCommInitRank",
    comm_init_rank_config: PFN_ncclCommInitRankConfig = "ncclCommInitRankConfig",
    comm_split: PFN_ncclCommSplit = "ncclCommSplit",
    comm_finalize: PFN_ncclCommFinalize = "ncclCommFinalize",
    comm_destroy: PFN_ncclCommDestroy = "ncclCommDestroy",
    comm_abort: PFN_ncclCommAbort = "ncclCommAbort",
    comm_get_async_error: PFN_ncclCommGetAsyncError = "ncclCommGetAsyncError",
    comm_count: PFN_ncclCommCount = "ncclCommCount",
    comm_cu_device: PFN_ncclCommCuDevice = "ncclCommCuDevice",
    comm_user_rank: PFN_ncclCommUserRank = "ncclCommUserRank",
    all_reduce: PFN_ncclAllReduce = "ncclAllReduce",
    broadcast: PFN_ncclBroadcast = "ncclBroadcast",
    reduce: PFN_ncclReduce = "ncclReduce",
    all_gather: PFN_ncclAllGather = "ncclAllGather",
    reduce_scatter: PFN_ncclReduceScatter = "ncclReduceScatter",
    send: PFN_ncclSend = "ncclSend",
    recv: PFN_ncclRecv = "ncclRecv",
    group_start: PFN_ncclGroupStart = "ncclGroupStart",
    group_end: PFN_ncclGroupEnd = "ncclGroupEnd",
}

impl NcclApi {
    /// `Ok(())` for `ncclSuccess`, else [`CollectiveError::Nccl`] with NCCL's description of the
    /// code and its last warning (on `comm`, or the thread's when `comm` is null).
    pub(crate) fn check(
        &self,
        code: sys::ncclResult_t,
        operation: &'static str,
        comm: sys::ncclComm_t,
    ) -> Result<()> {
        match NcclCode::from_raw(code) {
            None => Ok(()),
            Some(kind) => Err(self.error(kind, code, operation, comm)),
        }
    }

    /// The typed error for a failed `code`.
    pub(crate) fn error(
        &self,
        kind: NcclCode,
        code: sys::ncclResult_t,
        operation: &'static str,
        comm: sys::ncclComm_t,
    ) -> CollectiveError {
        let description = self
            .get_error_string
            .get()
            .ok()
            // SAFETY: ncclGetErrorString takes any code and returns a static string or null.
            .and_then(|f| text(unsafe { f(code) }))
            .unwrap_or_else(|| "unknown error".to_owned());
        let last_error = self
            .get_last_error
            .get()
            .ok()
            // SAFETY: ncclGetLastError accepts a live communicator or null (the thread's last
            // warning); callers pass only handles they own and have not destroyed.
            .and_then(|f| text(unsafe { f(comm) }))
            .unwrap_or_default();
        CollectiveError::Nccl {
            code: kind,
            description,
            last_error,
            operation,
        }
    }
}

fn text(pointer: *const std::ffi::c_char) -> Option<String> {
    if pointer.is_null() {
        return None;
    }
    // SAFETY: NCCL returns NUL-terminated strings that live at least until the next NCCL call
    // on this thread; it is copied at once.
    Some(
        unsafe { CStr::from_ptr(pointer) }
            .to_string_lossy()
            .trim()
            .to_owned(),
    )
}

impl std::fmt::Debug for NcclApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let available = self.entry_points().iter().filter(|(_, ok)| *ok).count();
        f.debug_struct("NcclApi")
            .field("entry_points", &self.entry_points().len())
            .field("available", &available)
            .finish()
    }
}

/// NCCL's version, as `ncclGetVersion` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NcclVersion {
    /// The major version, e.g. 2.
    pub major: u32,
    /// The minor version, e.g. 28.
    pub minor: u32,
    /// The patch level, e.g. 9.
    pub patch: u32,
}

impl NcclVersion {
    /// Splits `ncclGetVersion`'s code (`major * 10000 + minor * 100 + patch` since 2.9, and
    /// `major * 1000 + minor * 100 + patch` before).
    pub fn from_code(code: u32) -> Self {
        if code >= 10000 {
            Self {
                major: code / 10000,
                minor: (code % 10000) / 100,
                patch: code % 100,
            }
        } else {
            Self {
                major: code / 1000,
                minor: (code % 1000) / 100,
                patch: code % 100,
            }
        }
    }

    /// The code `nccl.h` writes as `NCCL_VERSION(major, minor, patch)`.
    pub fn code(self) -> u32 {
        if self.major <= 2 && self.minor <= 8 {
            self.major * 1000 + self.minor * 100 + self.patch
        } else {
            self.major * 10000 + self.minor * 100 + self.patch
        }
    }
}

impl std::fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The loaded library: where it came from, its version and its table.
pub struct Nccl {
    api: NcclApi,
    version: NcclVersion,
    path: String,
    // Keeps the code the table points into mapped for the life of the process.
    _library: libloading::Library,
}

impl Nccl {
    /// The entry points.
    pub fn api(&self) -> &NcclApi {
        &self.api
    }

    /// The library's version.
    pub fn version(&self) -> NcclVersion {
        self.version
    }

    /// The candidate that loaded (a path, or a name the dynamic loader resolved).
    pub fn path(&self) -> &str {
        &self.path
    }
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("version", &self.version)
            .field("path", &self.path)
            .field("api", &self.api)
            .finish()
    }
}

static NCCL: OnceLock<Result<Nccl>> = OnceLock::new();

/// The process-wide NCCL, searched for and loaded on first use ([`LibrarySearch::from_env`]).
///
/// # Errors
/// [`CollectiveError::NotFound`] when no candidate loads; `Unsupported` when the library lacks
/// `ncclGetVersion`. Both are cached.
pub fn nccl() -> Result<&'static Nccl> {
    NCCL.get_or_init(|| load(&LibrarySearch::from_env()))
        .as_ref()
        .map_err(Clone::clone)
}

/// The process-wide NCCL's entry points (see [`nccl`]).
///
/// # Errors
/// As [`nccl`].
pub fn api() -> Result<&'static NcclApi> {
    Ok(nccl()?.api())
}

/// Whether an NCCL library loads on this machine.
pub fn is_available() -> bool {
    nccl().is_ok()
}

/// Opens the first of `search`'s candidates that loads, outside the process-wide cache (each call
/// opens it again; use [`nccl`] for the shared one).
///
/// # Errors
/// As [`nccl`].
pub fn load(search: &LibrarySearch) -> Result<Nccl> {
    let mut reason = String::from("no candidates");
    for candidate in &search.candidates {
        // SAFETY: opening NCCL runs its static initialisers, which have no preconditions on us.
        let library = match unsafe { libloading::Library::new(candidate) } {
            Ok(library) => library,
            Err(error) => {
                reason = error.to_string();
                continue;
            }
        };
        let api = NcclApi::resolve(&mut |name: &str| {
            let mut symbol = Vec::with_capacity(name.len() + 1);
            symbol.extend_from_slice(name.as_bytes());
            symbol.push(0);
            // SAFETY: only the address is read here; it is called later through the type
            // `nccl.h` declares for it, and the library stays loaded (kept in `Nccl`).
            let address = unsafe { library.get::<*mut c_void>(&symbol) }.ok()?;
            NonNull::new(*address)
        });
        let get_version = api.get_version.get()?;
        let mut code = 0;
        // SAFETY: `code` is a valid out-pointer.
        let status = unsafe { get_version(&mut code) };
        api.check(status, "ncclGetVersion", std::ptr::null_mut())?;
        let version = NcclVersion::from_code(u32::try_from(code).unwrap_or(0));
        let path = candidate.to_string_lossy().into_owned();
        tracing::debug!(%version, path, "NCCL loaded");
        return Ok(Nccl {
            api,
            version,
            path,
            _library: library,
        });
    }
    Err(CollectiveError::NotFound {
        tried: search.tried(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn the_path_variable_is_the_only_candidate_when_set() {
        let search = LibrarySearch::with_env(|name| {
            (name == NCCL_PATH_VAR).then(|| OsString::from("/nowhere/libnccl.so.2"))
        });
        assert_eq!(
            search.candidates,
            vec![OsString::from("/nowhere/libnccl.so.2")]
        );
        let error = load(&search).expect_err("nothing at that path");
        match error {
            CollectiveError::NotFound { tried, reason } => {
                assert_eq!(tried, vec!["/nowhere/libnccl.so.2".to_owned()]);
                assert!(!reason.is_empty());
            }
            other => panic!("expected NotFound, got {other:?}"),
        }
    }

    #[test]
    fn names_come_first_then_wheels_found_on_pythonpath() {
        let root = std::env::temp_dir().join(format!("cuweave-nccl-search-{}", std::process::id()));
        let lib = root.join("nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).expect("temp dir");
        std::fs::write(lib.join("libnccl.so.2"), b"not a library").expect("temp file");
        let env: HashMap<&str, OsString> =
            HashMap::from([("PYTHONPATH", root.clone().into_os_string())]);
        let search = LibrarySearch::with_env(|name| env.get(name).cloned());
        assert_eq!(search.candidates[0], OsString::from("libnccl.so.2"));
        assert_eq!(search.candidates[1], OsString::from("libnccl.so"));
        assert!(search.site_packages.contains(&root));
        assert!(
            search
                .candidates
                .contains(&root.join(WHEEL_LIBRARY).into_os_string())
        );
        std::fs::remove_dir_all(&root).expect("clean up");
    }

    #[test]
    fn a_file_that_is_not_a_library_is_not_found_never_a_panic() {
        let root = std::env::temp_dir().join(format!("cuweave-nccl-bad-{}", std::process::id()));
        std::fs::create_dir_all(&root).expect("temp dir");
        let fake = root.join("libnccl.so.2");
        std::fs::write(&fake, b"not a library").expect("temp file");
        let search = LibrarySearch {
            candidates: vec![fake.into_os_string()],
            site_packages: Vec::new(),
        };
        assert!(load(&search).expect_err("not an ELF").is_not_found());
        std::fs::remove_dir_all(&root).expect("clean up");
    }

    #[test]
    fn versions_split_both_encodings() {
        assert_eq!(
            NcclVersion::from_code(22809),
            NcclVersion {
                major: 2,
                minor: 28,
                patch: 9
            }
        );
        assert_eq!(
            NcclVersion::from_code(2804),
            NcclVersion {
                major: 2,
                minor: 8,
                patch: 4
            }
        );
        assert_eq!(NcclVersion::from_code(22809).code(), 22809);
        assert_eq!(NcclVersion::from_code(2804).code(), 2804);
        assert_eq!(NcclVersion::from_code(23203).to_string(), "2.32.3");
    }

    extern "C" fn placeholder() {}

    #[test]
    fn absent_symbols_are_unsupported_at_use() {
        let api = NcclApi::resolve(&mut |name: &str| {
            (name == "ncclGetVersion")
                .then(|| NonNull::new(placeholder as *mut c_void).expect("address"))
        });
        assert!(api.get_version.is_available());
        assert!(matches!(
            api.all_reduce.get().err(),
            Some(CollectiveError::Unsupported {
                symbol: "ncclAllReduce"
            })
        ));
    }
}
