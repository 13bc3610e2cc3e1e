//! C-like enums whose values travel (in frames, through the C ABI) and whose names
//! appear in errors, tables and command lines. One declaration gives the stable
//! discriminants, `ALL`, `from_u8`, `name`, `from_name` and `Display`.

/// Declares a C-like enum whose values travel and whose names are printed:
/// stable `u8` discriminants, `ALL`, `from_u8`, `name`, `from_name` and
/// `Display` from one declaration (`Variant = value => "name",` per variant).
/// Used by fairring-core's own types and by the layers above it.
#[macro_export]
macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $value:literal => $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum $name {
            $( $(#[$vmeta])* $variant = $value, )+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The value with this discriminant, if there is one.
            pub const fn from_u8(value: u8) -> Option<$name> {
                match value {
                    $($value => Some($name::$variant),)+
                    _ => None,
                }
            }

            /// The name used in errors, tables and command lines.
            pub const fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }

            /// Parses a name as [`Self::name`] prints it.
            pub fn from_name(name: &str) -> Option<$name> {
                $name::ALL.iter().copied().find(|v| v.name() == name)
            }
        }

        impl core::fmt::Display for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

pub(crate) use crate::named_enum;
