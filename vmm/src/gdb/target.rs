//! The target description (`qXfer:features:read`): which registers exist, their numbers and
//! sizes, as the stub declares them. QEMU's x86-64 description adds control registers,
//! `fs_base`/`gs_base`/`k_gs_base` and `efer` to the core set.

/// One register of the target description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegisterInfo {
    /// Name, e.g. `rip`, `cr3`, `gs_base`.
    pub name: String,
    /// Number used by `p`/`P`.
    pub regnum: u32,
    /// Size in bits.
    pub bitsize: u32,
}

/// Errors of reading a target description.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// The XML is malformed.
    #[error("the target description is not well-formed XML")]
    Xml(#[from] roxmltree::Error),
    /// An attribute is not a number.
    #[error("register {name} has a bad {attribute}")]
    BadAttribute {
        /// Register name.
        name: String,
        /// Attribute.
        attribute: &'static str,
    },
}

/// Files a description includes with `<xi:include href=.../>`, in order.
///
/// # Errors
/// Malformed XML.
pub fn includes(xml: &str) -> Result<Vec<String>, TargetError> {
    let xml = without_xi_prefix(xml);
    let doc = roxmltree::Document::parse_with_options(&xml, options())?;
    Ok(doc
        .descendants()
        .filter(|n| n.tag_name().name() == "include")
        .filter_map(|n| n.attribute("href").map(str::to_owned))
        .collect())
}

/// QEMU writes `<xi:include>` without declaring the `xi` namespace, which a conforming XML
/// parser rejects; the prefix carries no meaning for us.
fn without_xi_prefix(xml: &str) -> String {
    xml.replace("<xi:include", "<include")
}

fn options<'a>() -> roxmltree::ParsingOptions<'a> {
    roxmltree::ParsingOptions {
        allow_dtd: true,
        ..Default::default()
    }
}

/// Appends the `<reg>` elements of one description document to `regs`, numbering registers
/// without `regnum` after the previous one, as GDB does.
///
/// # Errors
/// Malformed XML or attributes.
pub fn collect_registers(xml: &str, regs: &mut Vec<RegisterInfo>) -> Result<(), TargetError> {
    let xml = without_xi_prefix(xml);
    let doc = roxmltree::Document::parse_with_options(&xml, options())?;
    for reg in doc.descendants().filter(|n| n.tag_name().name() == "reg") {
        let name = reg.attribute("name").unwrap_or_default().to_owned();
        let number = |attr: &'static str| -> Result<Option<u32>, TargetError> {
            reg.attribute(attr)
                .map(|v| {
                    v.parse().map_err(|_| TargetError::BadAttribute {
                        name: name.clone(),
                        attribute: attr,
                    })
                })
                .transpose()
        };
        let bitsize = number("bitsize")?.ok_or_else(|| TargetError::BadAttribute {
            name: name.clone(),
            attribute: "bitsize",
        })?;
        let regnum = match number("regnum")? {
            Some(n) => n,
            None => regs.last().map_or(0, |r| r.regnum + 1),
        };
        regs.push(RegisterInfo {
            name,
            regnum,
            bitsize,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOP: &str = r#"<?xml version="1.0"?>
<!DOCTYPE target SYSTEM "gdb-target.dtd">
<target><architecture>i386:x86-64</architecture>
<xi:include href="i386-64bit.xml"/></target>"#;

    const CORE: &str = r#"<?xml version="1.0"?>
<!DOCTYPE feature SYSTEM "gdb-target.dtd">
<feature name="org.gnu.gdb.i386.core">
  <reg name="rax" bitsize="64" type="int64"/>
  <reg name="rbx" bitsize="64" type="int64"/>
  <reg name="rip" bitsize="64" type="code_ptr" regnum="16"/>
  <reg name="eflags" bitsize="32" type="i386_eflags"/>
  <reg name="cr3" bitsize="64" type="int64" regnum="40"/>
  <reg name="cr4" bitsize="64" type="int64"/>
</feature>"#;

    #[test]
    fn includes_are_listed() {
        assert_eq!(includes(TOP).unwrap(), ["i386-64bit.xml"]);
    }

    #[test]
    fn registers_are_numbered_like_gdb_does() {
        let mut regs = Vec::new();

        collect_registers(CORE, &mut regs).unwrap();

        let got: Vec<(&str, u32, u32)> = regs
            .iter()
            .map(|r| (r.name.as_str(), r.regnum, r.bitsize))
            .collect();
        assert_eq!(
            got,
            [
                ("rax", 0, 64),
                ("rbx", 1, 64),
                ("rip", 16, 64),
                ("eflags", 17, 32),
                ("cr3", 40, 64),
                ("cr4", 41, 64)
            ]
        );
    }

    #[test]
    fn bad_xml_and_bad_sizes_are_errors() {
        let mut regs = Vec::new();

        assert!(collect_registers("<feature><reg", &mut regs).is_err());
        assert!(matches!(
            collect_registers(
                r#"<feature><reg name="x" bitsize="big"/></feature>"#,
                &mut regs
            ),
            Err(TargetError::BadAttribute {
                attribute: "bitsize",
                ..
            })
        ));
    }
}
