//! Putting a compiled run into the guest: the data and the table helpers written to the
//! patch heap, then the sites' code generated and spliced in, at the start and when a
//! probed kernel module loads ([`super::modules`]).

use std::collections::{BTreeMap, HashMap};

use anyhow::bail;

use crate::compile::{
    self, codegen::Env, DataLayout, Facts, Interner, Runtime, SiteBodies, SitePoint,
};
use crate::lang::check::Program;
use crate::lang::runtime::Session;
use crate::lang::Limits;

use super::guest::{Guest, Sites};
use super::modules;
use super::plan::Plan;
use crate::live::session::GuestSession;
use crate::live::splicer::{Action, Request};

/// What an install puts in: the program, its points and the kernel's facts (slid).
#[derive(Clone, Copy)]
pub(super) struct Install<'a> {
    pub(super) prog: &'a Program,
    pub(super) limits: &'a Limits,
    pub(super) plan: &'a Plan,
    pub(super) facts: &'a Facts,
    pub(super) slide: u64,
}

/// Generates the sites' code and the data, writes them and installs the splices; returns the
/// guest side.
pub(super) fn install(
    mut guest: GuestSession,
    what: &Install<'_>,
    session: &Session<'_>,
) -> anyhow::Result<Guest> {
    let Install {
        prog,
        limits,
        plan,
        facts,
        slide,
    } = *what;
    #[allow(clippy::type_complexity)]
    let r = (|| -> anyhow::Result<(DataLayout, u64, Interner, HashMap<u64, u64>, Helpers)> {
        let mut layout = DataLayout::new(prog, limits).map_err(|u| {
            anyhow::anyhow!(
                "{}",
                u.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            )
        })?;
        if compile::codegen::prints(prog) {
            let cpus = u32::try_from(guest.parts()?.1.cpus())?;
            layout = layout.with_rings(cpus);
        }
        let data = guest.alloc(layout.size, 64)?;
        // Assembled once to learn its size, then again where it goes.
        let size = compile::runtime(&layout, data, data)?.code.len() as u64;
        let rt_at = guest.alloc(size.max(16), 16)?;
        let rt: Runtime = compile::runtime(&layout, data, rt_at)?;
        let mut interner = Interner::default();
        let mut bytes = layout.initial(prog, &mut interner);
        for name in layout.globals.keys() {
            if let Some(store) = session.global(name) {
                if let Err(e) = layout.encode_into(name, store, &mut interner, &mut bytes) {
                    tracing::warn!("{name} starts empty in the guest: {e}");
                }
            }
        }
        bytes.resize(usize::try_from(layout.size)?, 0);
        guest.write_heap(data, &bytes)?;
        if !rt.code.is_empty() {
            guest.write_heap(rt_at, &rt.code)?;
        }
        let env = Env {
            prog,
            limits,
            facts,
            layout: &layout,
            data,
            helpers: &rt.helpers,
        };
        let points: Vec<(u64, SitePoint)> = plan
            .points
            .iter()
            .map(|(link, p)| (link.wrapping_add(slide), p.clone()))
            .collect();
        let (sites, report) = install_sites(&mut guest, env, &mut interner, &points)?;
        if sites > 0 && report.refused.len() == sites {
            bail!(
                "none of the script's kernel probe points could be spliced: {}",
                report
                    .refused
                    .iter()
                    .map(|r| format!("{}: {}", r.name, r.reason))
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
        tracing::info!(
            "compiled probes in at {} sites ({} refused), {} KiB of data, planned in {:.3} s",
            guest.splicer().map_or(0, |s| s.installed.len()),
            report.refused.len(),
            layout.size >> 10,
            report.plan_time.as_secs_f64()
        );
        Ok((
            layout,
            data,
            interner,
            report.entered.into_iter().collect(),
            rt.helpers,
        ))
    })();
    // On an error, dropping the session takes out whatever went in and detaches.
    let (layout, data, interner, entered, helpers) = r?;
    Ok(Guest {
        session: guest,
        layout,
        data,
        interner,
        taken: Vec::new(),
        lost: 0,
        entered,
        pulled: None,
        stacks: None,
        collections: Default::default(),
        helpers,
    })
}

/// The table helpers' addresses, by (global, insert).
type Helpers = HashMap<(String, bool), u64>;

/// A module's load or unload seen at the watch's breakpoint (the guest stopped): the sites of
/// the script's points in a loading module go in before its code runs.
///
/// # Errors
/// As [`modules::ModuleWatch::stopped`] and [`install_sites`].
pub(super) fn module_event(
    guest: &mut Guest,
    watch: &mut modules::ModuleWatch,
    (prog, limits, facts): (&Program, &Limits, &Facts),
    (vcpu, pc): (exotap_vmm::control::VcpuId, u64),
) -> anyhow::Result<()> {
    let points = match watch.stopped(&mut guest.session, vcpu, pc)? {
        modules::ModuleEvent::Loaded(points) if !points.is_empty() => points,
        modules::ModuleEvent::Unloading(text) => {
            // Sites a breakpoint entered: their breakpoints go with the module's text (a
            // module loaded there later must not stop in them).
            let gone: Vec<u64> = guest
                .entered
                .keys()
                .copied()
                .filter(|a| text.contains(a))
                .collect();
            for site in gone {
                guest.session.machine.set_breakpoint(site, false)?;
                guest.entered.remove(&site);
            }
            return Ok(());
        }
        _ => return Ok(()),
    };
    let env = Env {
        prog,
        limits,
        facts,
        layout: &guest.layout,
        data: guest.data,
        helpers: &guest.helpers,
    };
    let (sites, report) = install_sites(&mut guest.session, env, &mut guest.interner, &points)?;
    guest.entered.extend(report.entered.iter().copied());
    watch.sites_in += (sites - report.refused.len()) as u64;
    tracing::info!(
        "{} sites in the loading module ({} refused)",
        sites - report.refused.len(),
        report.refused.len()
    );
    Ok(())
}

/// Generates the code of the compiled sites at `points` (running addresses; the points at
/// one address share its site) and installs their splices, the guest stopped. Sites the
/// planner refuses are logged; a site a breakpoint enters gets its breakpoint. Returns the
/// number of sites asked for and the install's report.
///
/// # Errors
/// When the code cannot be generated or written.
fn install_sites(
    guest: &mut GuestSession,
    env: Env<'_>,
    interner: &mut Interner,
    points: &[(u64, SitePoint)],
) -> anyhow::Result<(usize, crate::live::splicer::InstallReport)> {
    // One site per address: its entry bodies and its return bodies.
    let mut by_addr: BTreeMap<u64, SiteBodies> = BTreeMap::new();
    let mut names: HashMap<u64, String> = HashMap::new();
    // The probe points at each address, for what is said of a refused one.
    let mut points_at: HashMap<u64, Vec<String>> = HashMap::new();
    for (addr, p) in points {
        let site = by_addr.entry(*addr).or_insert_with(|| SiteBodies {
            pc: *addr,
            ..SiteBodies::default()
        });
        names.entry(*addr).or_insert_with(|| p.function.clone());
        let named = points_at.entry(*addr).or_default();
        if !named.contains(&p.name) {
            named.push(p.name.clone());
        }
        if p.is_return {
            site.ret.push(p.clone());
        } else {
            site.entry.push(p.clone());
        }
    }
    let mut requests = Vec::new();
    let mut bodies = Vec::new();
    for (addr, b) in by_addr {
        requests.push(Request {
            name: names.get(&addr).cloned().unwrap_or_default(),
            addr,
            action: Action::Compiled(u32::try_from(bodies.len())?),
        });
        bodies.push(b);
    }
    let mut sites = Sites {
        env,
        interner: &mut *interner,
        bodies,
        addrs: requests.iter().map(|r| r.addr).collect(),
    };
    let report = guest.install_compiled(&requests, &mut sites)?;
    // The code may hold the encodings of strings placed so far: the collector keeps them.
    interner.pin_placed();
    for r in &report.refused {
        let named = points_at
            .get(&r.addr)
            .map_or_else(String::new, |n| n.join(", "));
        tracing::warn!(
            "{named} in {} ({:#x}) not instrumented: {}",
            r.name,
            r.addr,
            r.reason
        );
    }
    for (site, _) in &report.entered {
        guest.machine.set_breakpoint(*site, true)?;
    }
    Ok((requests.len(), report))
}
