//! [`CommConfig`]: how communicators are made (NCCL's `ncclConfig_t` tuning fields) and how long
//! their work may take; and how a config reaches NCCL.
//!
//! # How a config reaches NCCL, whichever NCCL is loaded
//!
//! The `ncclConfig_t` cuweave fills is the one of the header the bindings were generated from
//! (`sys::NCCL_VERSION_CODE`), with `size`, `magic` (`0xcafebeef`) and `version` set as
//! `NCCL_CONFIG_INITIALIZER` sets them and every field the user left alone at
//! `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`) or `NULL`. NCCL's `parseCommConfig` (src/init.cc, 2.28)
//! copies `min(size, sizeof(its own ncclConfig_t))` bytes over its own initializer, refuses a
//! wrong `magic`, and resets to its default only the fields a header *older* than their
//! introduction could not have set (`version` below 2.17, 2.25, …). Fields are only ever
//! appended, so a struct from a newer header is accepted by an older library: the fields past its
//! own struct are never read. Left undefined, that is harmless. Set, it would be silently
//! ignored, so a field the loaded NCCL is too old for is refused instead with
//! [`CollectiveError::ConfigUnsupported`] (every field here is known to NCCL 2.27 and later).
//!
//! Strings: `parseCommConfig` runs inside `ncclCommInitRankConfig` / `ncclCommSplit` before
//! they return (a non-blocking initialisation only defers the rest to NCCL's thread);
//! `envConfigOverride` copies `netName` there (`malloc` + `memcpy`), but `commName` is kept as
//! the caller's pointer and read later on NCCL's thread (the profiler plugin's `init` gets it
//! during the asynchronous initialisation). So both strings are owned by the communicator's
//! handle slot ([`crate::raw::HandleSlot`]), which lives as long as the communicator, or for ever
//! when an initialisation failed (NCCL's thread may still hold the addresses).

use std::ffi::{CString, c_int};
use std::time::Duration;

use crate::error::{CollectiveError, Result};
use crate::loader::NcclVersion;
use crate::sys;

/// `NCCL_CONFIG_UNDEF_INT`: NCCL chooses.
const UNDEF: c_int = c_int::MIN;

/// `MAXCHANNELS` of NCCL 2.28 (and of every release since 2.12): the most CTAs (channels) a
/// collective may use, and NCCL's default `maxCTAs`.
pub const MAX_CTAS: u32 = 64;

/// `NCCL_MAX_CGA_CLUSTER_SIZE`: the largest thread-block cluster a CUDA launch accepts portably.
pub const MAX_CGA_CLUSTER_SIZE: u32 = 8;

/// How communicators are made and how long their work may take.
///
/// Every NCCL tuning field is an `Option`: `None` (the default) leaves NCCL's own default
/// (`NCCL_CONFIG_UNDEF_INT` / `NULL` in `ncclConfig_t`), so [`CommConfig::default`] is exactly
/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`. NCCL's environment variables
/// (`NCCL_CGA_CLUSTER_SIZE`, `NCCL_MIN_CTAS`, `NCCL_MAX_CTAS`, `NCCL_NET`,
/// `NCCL_COMM_SPLIT_SHARE_RESOURCES`, `NCCL_COMM_BLOCKING`) override the fields when set.
///
/// Values out of range are refused before NCCL is called, by every initialisation
/// ([`Communicator::init_all`](crate::Communicator::init_all),
/// [`init_rank`](crate::Communicator::init_rank)) with
/// [`CollectiveError::InvalidConfig`]; [`validate`](Self::validate) checks them on their own.
/// A communicator made by [`split`](crate::Communicator::split) or
/// [`split_all`](crate::Communicator::split_all) gets its parent's config.
///
/// ```
/// use std::time::Duration;
/// use cuweave_collective::CommConfig;
///
/// let config = CommConfig::new()
///     .with_timeout(Duration::from_secs(30))
///     .with_comm_name("dp-group")
///     .with_min_ctas(2)
///     .with_max_ctas(16)
///     .with_split_share(true);
/// config.validate().expect("in range");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CommConfig {
    /// Make the communicator blocking (`ncclConfig_t::blocking = 1`). The default is
    /// non-blocking: initialisation, splits and collectives return at once and cuweave polls
    /// `ncclCommGetAsyncError`, so a peer that never arrives becomes a [`Timeout`] instead of a
    /// hang. A blocking communicator can only time out in
    /// [`Communicator::synchronize`](crate::Communicator::synchronize) and futures, not inside
    /// NCCL's own calls.
    ///
    /// [`Timeout`]: CollectiveError::Timeout
    pub blocking: bool,
    /// The deadline for initialisation, splits, finalisation and each wait for queued work
    /// ([`Communicator::synchronize`](crate::Communicator::synchronize),
    /// [`Communicator::completion`](crate::Communicator::completion)). When it passes the
    /// communicator is aborted and the call returns [`CollectiveError::Timeout`].
    pub timeout: Duration,
    /// `cgaClusterSize`: thread blocks per cluster in NCCL's kernels, 0 to 8 (see
    /// [`with_cga_cluster_size`](Self::with_cga_cluster_size)).
    pub cga_cluster_size: Option<u32>,
    /// `minCTAs`: the fewest CTAs (channels) a collective uses, 1 to 64 (see
    /// [`with_min_ctas`](Self::with_min_ctas)).
    pub min_ctas: Option<u32>,
    /// `maxCTAs`: the most CTAs (channels) a collective uses, 1 to 64 (see
    /// [`with_max_ctas`](Self::with_max_ctas)).
    pub max_ctas: Option<u32>,
    /// `netName`: the network plugin to use, e.g. `"IB"` or `"Socket"` (see
    /// [`with_net_name`](Self::with_net_name)).
    pub net_name: Option<String>,
    /// `splitShare`: whether communicators split from this one share its resources (see
    /// [`with_split_share`](Self::with_split_share)).
    pub split_share: Option<bool>,
    /// `commName`: a name for NCCL's logs and the profiler plugin (see
    /// [`with_comm_name`](Self::with_comm_name)).
    pub comm_name: Option<String>,
    /// `trafficClass`: the network traffic class (QoS) given to the net plugin (see
    /// [`with_traffic_class`](Self::with_traffic_class)).
    pub traffic_class: Option<i32>,
}

impl Default for CommConfig {
    fn default() -> Self {
        Self {
            blocking: false,
            timeout: Duration::from_secs(120),
            cga_cluster_size: None,
            min_ctas: None,
            max_ctas: None,
            net_name: None,
            split_share: None,
            comm_name: None,
            traffic_class: None,
        }
    }
}

impl CommConfig {
    /// The default: non-blocking, a 120 s deadline, every NCCL tuning field NCCL's default.
    pub fn new() -> Self {
        Self::default()
    }

    /// With another deadline.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Blocking or not.
    pub fn with_blocking(mut self, blocking: bool) -> Self {
        self.blocking = blocking;
        self
    }

    /// `cgaClusterSize`: on compute capability 9.0 and later NCCL launches its kernels in
    /// thread-block clusters of this many blocks (`CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`; it
    /// falls back to 1 when the grid does not divide by it); 0 launches without clusters. Older
    /// GPUs ignore it. Valid: 0 to 8 (NCCL's default is 4 on sm90). NCCL caps
    /// `NCCL_CGA_CLUSTER_SIZE` at 8 but passes a config value through to the launch, where more
    /// than 8 fails, so more than 8 is refused here.
    pub fn with_cga_cluster_size(mut self, size: u32) -> Self {
        self.cga_cluster_size = Some(size);
        self
    }

    /// `minCTAs`: the fewest CTAs (channels) NCCL gives a collective; more channels use more
    /// SMs and move more bytes at once. Valid: 1 to 64 (`MAXCHANNELS`), and no more than
    /// [`max_ctas`](Self::max_ctas) when that is set. When only `min_ctas` is set, cuweave sends
    /// `maxCTAs = 64` (NCCL's own default) with it: NCCL 2.28 compares `minCTAs > maxCTAs` even
    /// when `maxCTAs` is undefined (`INT_MIN`), and would refuse the config.
    pub fn with_min_ctas(mut self, ctas: u32) -> Self {
        self.min_ctas = Some(ctas);
        self
    }

    /// `maxCTAs`: the most CTAs (channels) NCCL gives a collective, leaving the other SMs to
    /// compute kernels running at the same time. Valid: 1 to 64 (`MAXCHANNELS`), and no less
    /// than [`min_ctas`](Self::min_ctas).
    pub fn with_max_ctas(mut self, ctas: u32) -> Self {
        self.max_ctas = Some(ctas);
        self
    }

    /// `netName`: the network plugin NCCL uses for traffic between hosts, matched without case
    /// against each plugin's name: the built-in `"IB"` (InfiniBand / RoCE) and `"Socket"`
    /// (TCP), or an external plugin's. NCCL copies the string during initialisation. A name no
    /// plugin has fails initialisation in NCCL (`ncclInvalidUsage`, "Failed to initialize any
    /// NET plugin"). Valid: a non-empty string without NUL bytes.
    pub fn with_net_name(mut self, name: impl Into<String>) -> Self {
        self.net_name = Some(name.into());
        self
    }

    /// `splitShare`: whether communicators split from this one ([`split`]) share its
    /// resources (channels, proxy thread, buffers) instead of allocating their own: cheaper
    /// children, but the parent and its children then cannot run collectives at the same time.
    /// NCCL reads it from the *parent* at each split; children made here get the parent's config,
    /// so they pass it on. Sharing includes NCCL's abort flag: aborting one of them (by hand, or
    /// after a timeout or an asynchronous error) stops NCCL's work on all of them, though only
    /// the aborted one refuses further calls here. NCCL's default is `false`.
    ///
    /// [`split`]: crate::Communicator::split
    pub fn with_split_share(mut self, share: bool) -> Self {
        self.split_share = Some(share);
        self
    }

    /// `commName`: a name for the communicator, shown in NCCL's `NCCL_DEBUG=INFO` logs ("Comm
    /// config Comm name set to …") and handed to the profiler plugin (torch's process-group
    /// description plays this part). NCCL keeps the pointer, so cuweave keeps the string alive
    /// as long as the communicator. NCCL 2.28 has no call that reads it back. Valid: any string
    /// without NUL bytes.
    pub fn with_comm_name(mut self, name: impl Into<String>) -> Self {
        self.comm_name = Some(name.into());
        self
    }

    /// `trafficClass`: the traffic class NCCL gives the network plugin for this communicator's
    /// connections (QoS). The built-in IB plugin uses it as the traffic class and service level
    /// of its queue pairs unless `NCCL_IB_TC` / `NCCL_IB_SL` are set; the socket plugin ignores
    /// it. Valid: 0 and up (negative values are the plugins' "undefined"; InfiniBand's traffic
    /// class is 8 bits, its service level 4).
    pub fn with_traffic_class(mut self, class: i32) -> Self {
        self.traffic_class = Some(class);
        self
    }

    /// Checks every NCCL tuning field against its valid range, as every initialisation does
    /// before calling NCCL.
    ///
    /// # Errors
    /// [`CollectiveError::InvalidConfig`] naming the first field out of range: a cluster size
    /// over 8, a CTA count of 0 or over 64, `min_ctas` over `max_ctas`, an empty `net_name`, a
    /// NUL byte in a name, or a negative traffic class.
    pub fn validate(&self) -> Result<()> {
        NcclConfig::validated(self).map(drop)
    }

    /// The fields set (not `None`), each with the NCCL release that introduced it.
    fn fields_set(&self) -> impl Iterator<Item = (&'static str, NcclVersion)> {
        let v = |minor| NcclVersion {
            major: 2,
            minor,
            patch: 0,
        };
        [
            ("cga_cluster_size", self.cga_cluster_size.is_some(), v(17)),
            ("min_ctas", self.min_ctas.is_some(), v(17)),
            ("max_ctas", self.max_ctas.is_some(), v(17)),
            ("net_name", self.net_name.is_some(), v(17)),
            ("split_share", self.split_share.is_some(), v(18)),
            ("traffic_class", self.traffic_class.is_some(), v(26)),
            ("comm_name", self.comm_name.is_some(), v(27)),
        ]
        .into_iter()
        .filter(|(_, set, _)| *set)
        .map(|(field, _, since)| (field, since))
    }
}

fn invalid(field: &'static str, value: impl std::fmt::Debug, reason: &str) -> CollectiveError {
    CollectiveError::InvalidConfig {
        field,
        value: format!("{value:?}"),
        reason: reason.to_owned(),
    }
}

fn ctas(field: &'static str, value: Option<u32>) -> Result<Option<c_int>> {
    match value {
        None => Ok(None),
        Some(n @ 1..=MAX_CTAS) => Ok(Some(n as c_int)),
        Some(n) => Err(invalid(
            field,
            n,
            "CTAs must be 1 to 64 (NCCL's MAXCHANNELS)",
        )),
    }
}

fn c_string(field: &'static str, value: Option<&String>) -> Result<Option<CString>> {
    value
        .map(|s| {
            CString::new(s.as_str()).map_err(|e| {
                invalid(
                    field,
                    s,
                    &format!("a NUL byte at {} cannot reach NCCL", e.nul_position()),
                )
            })
        })
        .transpose()
}

/// A validated [`CommConfig`] as NCCL takes it, owning the C strings the raw config points at.
#[derive(Debug)]
pub(crate) struct NcclConfig {
    blocking: bool,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    split_share: c_int,
    traffic_class: c_int,
    net_name: Option<CString>,
    comm_name: Option<CString>,
}

impl NcclConfig {
    /// Checks `config` and converts it (no NCCL involved).
    fn validated(config: &CommConfig) -> Result<Self> {
        let cga_cluster_size = match config.cga_cluster_size {
            None => UNDEF,
            Some(n @ 0..=MAX_CGA_CLUSTER_SIZE) => n as c_int,
            Some(n) => return Err(invalid("cga_cluster_size", n, "must be 0 to 8")),
        };
        let min = ctas("min_ctas", config.min_ctas)?;
        let max = ctas("max_ctas", config.max_ctas)?;
        if let (Some(min), Some(max)) = (min, max)
            && min > max
        {
            return Err(invalid(
                "min_ctas",
                min,
                &format!("must not exceed max_ctas ({max})"),
            ));
        }
        // NCCL 2.28 refuses `minCTAs > maxCTAs` with maxCTAs undefined (INT_MIN): send its
        // default maximum with a lone minimum.
        let max_ctas = match (min, max) {
            (_, Some(max)) => max,
            (Some(_), None) => MAX_CTAS as c_int,
            (None, None) => UNDEF,
        };
        if config.net_name.as_deref() == Some("") {
            return Err(invalid(
                "net_name",
                "",
                "no network plugin has an empty name",
            ));
        }
        let traffic_class = match config.traffic_class {
            None => UNDEF,
            Some(class) if class >= 0 => class,
            Some(class) => {
                return Err(invalid(
                    "traffic_class",
                    class,
                    "must be 0 or more (negative is a net plugin's \"undefined\")",
                ));
            }
        };
        Ok(Self {
            blocking: config.blocking,
            cga_cluster_size,
            min_ctas: min.unwrap_or(UNDEF),
            max_ctas,
            split_share: config.split_share.map_or(UNDEF, c_int::from),
            traffic_class,
            net_name: c_string("net_name", config.net_name.as_ref())?,
            comm_name: c_string("comm_name", config.comm_name.as_ref())?,
        })
    }

    /// Checks `config`, and that the `loaded` NCCL knows every field set (an older one would
    /// silently ignore it), and converts it.
    pub(crate) fn new(config: &CommConfig, loaded: NcclVersion) -> Result<Self> {
        let converted = Self::validated(config)?;
        if let Some((field, needs)) = config.fields_set().find(|(_, since)| loaded < *since) {
            return Err(CollectiveError::ConfigUnsupported {
                field,
                needs,
                loaded,
            });
        }
        Ok(converted)
    }

    /// The `ncclConfig_t`, as `NCCL_CONFIG_INITIALIZER` makes it with this config's fields set.
    /// Its string pointers borrow from `self`: pass it to NCCL while `self` is alive, and keep
    /// `self` alive as long as NCCL may read `commName` (the communicator's life).
    pub(crate) fn to_raw(&self) -> sys::ncclConfig_t {
        let ptr = |s: &Option<CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
        sys::ncclConfig_t {
            size: size_of::<sys::ncclConfig_t>(),
            magic: sys::NCCL_API_MAGIC,
            version: sys::NCCL_VERSION_CODE,
            blocking: c_int::from(self.blocking),
            cgaClusterSize: self.cga_cluster_size,
            minCTAs: self.min_ctas,
            maxCTAs: self.max_ctas,
            netName: ptr(&self.net_name),
            splitShare: self.split_share,
            trafficClass: self.traffic_class,
            commName: ptr(&self.comm_name),
            collnetEnable: UNDEF,
            CTAPolicy: UNDEF,
            shrinkShare: UNDEF,
            nvlsCTAs: UNDEF,
            nChannelsPerNetPeer: UNDEF,
            nvlinkCentricSched: UNDEF,
            graphUsageMode: UNDEF,
            numRmaCtx: UNDEF,
            maxP2pPeers: UNDEF,
            graphStreamOrdering: UNDEF,
            launchOrderImplicit: UNDEF,
            numRmaSig: UNDEF,
            rmaEagerInit: UNDEF,
            hostCftMode: UNDEF,
            nvlsHostMode: UNDEF,
        }
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    const NCCL_2_28: NcclVersion = NcclVersion {
        major: 2,
        minor: 28,
        patch: 3,
    };

    /// The config the crate sent before the tuning fields existed: `NCCL_CONFIG_INITIALIZER`
    /// with `blocking` set.
    fn initializer(blocking: bool) -> sys::ncclConfig_t {
        sys::ncclConfig_t {
            size: size_of::<sys::ncclConfig_t>(),
            magic: 0xcafe_beef,
            version: sys::NCCL_VERSION_CODE,
            blocking: c_int::from(blocking),
            cgaClusterSize: c_int::MIN,
            minCTAs: c_int::MIN,
            maxCTAs: c_int::MIN,
            netName: std::ptr::null(),
            splitShare: c_int::MIN,
            trafficClass: c_int::MIN,
            commName: std::ptr::null(),
            collnetEnable: c_int::MIN,
            CTAPolicy: c_int::MIN,
            shrinkShare: c_int::MIN,
            nvlsCTAs: c_int::MIN,
            nChannelsPerNetPeer: c_int::MIN,
            nvlinkCentricSched: c_int::MIN,
            graphUsageMode: c_int::MIN,
            numRmaCtx: c_int::MIN,
            maxP2pPeers: c_int::MIN,
            graphStreamOrdering: c_int::MIN,
            launchOrderImplicit: c_int::MIN,
            numRmaSig: c_int::MIN,
            rmaEagerInit: c_int::MIN,
            hostCftMode: c_int::MIN,
            nvlsHostMode: c_int::MIN,
        }
    }

    #[rstest]
    #[case::non_blocking(false)]
    #[case::blocking(true)]
    fn the_default_is_nccls_initializer_with_blocking_set(#[case] blocking: bool) {
        let config = CommConfig::new().with_blocking(blocking);
        let raw = NcclConfig::new(&config, NCCL_2_28).expect("valid").to_raw();
        assert_eq!(raw, initializer(blocking));
    }

    #[test]
    fn every_field_set_reaches_the_raw_config() {
        let config = CommConfig::new()
            .with_cga_cluster_size(2)
            .with_min_ctas(3)
            .with_max_ctas(9)
            .with_net_name("Socket")
            .with_split_share(true)
            .with_comm_name("grads")
            .with_traffic_class(106);
        let nccl = NcclConfig::new(&config, NCCL_2_28).expect("valid");
        let raw = nccl.to_raw();
        assert_eq!(
            (
                raw.cgaClusterSize,
                raw.minCTAs,
                raw.maxCTAs,
                raw.splitShare,
                raw.trafficClass
            ),
            (2, 3, 9, 1, 106)
        );
        // The pointers lead to `nccl`'s own strings.
        let net = nccl.net_name.as_deref().expect("net name");
        let name = nccl.comm_name.as_deref().expect("comm name");
        assert_eq!((raw.netName, raw.commName), (net.as_ptr(), name.as_ptr()));
        assert_eq!(net, c"Socket");
        assert_eq!(name, c"grads");
        // The rest stays as NCCL's initializer has it.
        let rest = sys::ncclConfig_t {
            cgaClusterSize: c_int::MIN,
            minCTAs: c_int::MIN,
            maxCTAs: c_int::MIN,
            netName: std::ptr::null(),
            splitShare: c_int::MIN,
            trafficClass: c_int::MIN,
            commName: std::ptr::null(),
            ..raw
        };
        assert_eq!(rest, initializer(false));
    }

    #[rstest]
    #[case::min_alone_brings_nccls_default_max(Some(4), None, 4, 64)]
    #[case::max_alone_leaves_min_undefined(None, Some(4), c_int::MIN, 4)]
    #[case::equal(Some(8), Some(8), 8, 8)]
    #[case::full_range(Some(1), Some(64), 1, 64)]
    #[case::neither(None, None, c_int::MIN, c_int::MIN)]
    fn cta_bounds_reach_nccl_in_a_form_it_accepts(
        #[case] min: Option<u32>,
        #[case] max: Option<u32>,
        #[case] want_min: c_int,
        #[case] want_max: c_int,
    ) {
        let config = CommConfig {
            min_ctas: min,
            max_ctas: max,
            ..CommConfig::default()
        };
        let raw = NcclConfig::new(&config, NCCL_2_28).expect("valid").to_raw();
        assert_eq!((raw.minCTAs, raw.maxCTAs), (want_min, want_max));
    }

    #[rstest]
    #[case::cga_cluster_over_8(CommConfig::new().with_cga_cluster_size(9), "cga_cluster_size")]
    #[case::min_ctas_zero(CommConfig::new().with_min_ctas(0), "min_ctas")]
    #[case::min_ctas_over_64(CommConfig::new().with_min_ctas(65), "min_ctas")]
    #[case::max_ctas_zero(CommConfig::new().with_max_ctas(0), "max_ctas")]
    #[case::max_ctas_over_64(CommConfig::new().with_max_ctas(65), "max_ctas")]
    #[case::min_over_max(CommConfig::new().with_min_ctas(5).with_max_ctas(4), "min_ctas")]
    #[case::empty_net_name(CommConfig::new().with_net_name(""), "net_name")]
    #[case::nul_in_net_name(CommConfig::new().with_net_name("I\0B"), "net_name")]
    #[case::nul_in_comm_name(CommConfig::new().with_comm_name("grads\0"), "comm_name")]
    #[case::negative_traffic_class(CommConfig::new().with_traffic_class(-1), "traffic_class")]
    #[case::undef_traffic_class(CommConfig::new().with_traffic_class(i32::MIN), "traffic_class")]
    fn out_of_range_fields_are_a_typed_error(
        #[case] config: CommConfig,
        #[case] want_field: &'static str,
    ) {
        for error in [
            config.validate().expect_err("invalid"),
            NcclConfig::new(&config, NCCL_2_28).expect_err("invalid"),
        ] {
            match error {
                CollectiveError::InvalidConfig { field, .. } => assert_eq!(field, want_field),
                other => panic!("{other:?}"),
            }
        }
    }

    #[rstest]
    #[case::cga_cluster_0(CommConfig::new().with_cga_cluster_size(0))]
    #[case::cga_cluster_8(CommConfig::new().with_cga_cluster_size(8))]
    #[case::empty_comm_name(CommConfig::new().with_comm_name(""))]
    #[case::traffic_class_0(CommConfig::new().with_traffic_class(0))]
    #[case::split_share_off(CommConfig::new().with_split_share(false))]
    fn edge_values_are_valid(#[case] config: CommConfig) {
        config.validate().expect("valid");
    }

    #[rstest]
    #[case::comm_name_before_2_27(CommConfig::new().with_comm_name("x"), 26, Some("comm_name"))]
    #[case::traffic_class_before_2_26(CommConfig::new().with_traffic_class(0), 25, Some("traffic_class"))]
    #[case::split_share_before_2_18(CommConfig::new().with_split_share(true), 17, Some("split_share"))]
    #[case::ctas_before_2_17(CommConfig::new().with_max_ctas(2), 16, Some("max_ctas"))]
    #[case::comm_name_on_2_27(CommConfig::new().with_comm_name("x"), 27, None)]
    #[case::nothing_set_on_2_14(CommConfig::new(), 14, None)]
    fn a_field_the_loaded_nccl_would_ignore_is_refused(
        #[case] config: CommConfig,
        #[case] minor: u32,
        #[case] want: Option<&str>,
    ) {
        let loaded = NcclVersion {
            major: 2,
            minor,
            patch: 9,
        };
        match (NcclConfig::new(&config, loaded), want) {
            (Ok(_), None) => {}
            (Err(CollectiveError::ConfigUnsupported { field, needs, .. }), Some(want)) => {
                assert_eq!(field, want);
                assert!(loaded < needs);
            }
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }
}
