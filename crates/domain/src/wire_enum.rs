//! `wire_enum!`: a closed set of values whose discriminant is the wire
//! value and whose text is the stable name clients see, written once so the
//! list, the names and the decoding cannot drift apart.

/// Declares the enum with `ALL` (in wire order), `as_str`, `as_i32` and
/// `from_i32` (`None` for a value this build does not know).
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident : $repr:ident {
            $( $(#[$variant_meta:meta])* $variant:ident = $value:literal => $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[repr($repr)]
        pub enum $name {
            $( $(#[$variant_meta])* $variant = $value, )+
        }

        impl $name {
            pub const ALL: [$name; [$($text),+].len()] = [$(Self::$variant),+];

            /// The stable text name.
            pub fn as_str(self) -> &'static str {
                match self {
                    $( Self::$variant => $text, )+
                }
            }

            pub fn as_i32(self) -> i32 {
                self as i32
            }

            pub fn from_i32(value: i32) -> Option<Self> {
                Self::ALL.into_iter().find(|v| v.as_i32() == value)
            }
        }
    };
}
