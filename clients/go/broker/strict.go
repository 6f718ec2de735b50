package broker

import "math/big"

// Strict point checks for ed25519 verification, on public data only (not
// constant time). crypto/ed25519 accepts non-canonical public keys and
// small-order points; RFC 8032's strict verification, which the broker and
// the other clients apply, does not.

var (
	fieldP = new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 255), big.NewInt(19))
	// curveD = -121665/121666 mod p.
	curveD = func() *big.Int {
		inv := new(big.Int).ModInverse(big.NewInt(121666), fieldP)
		d := new(big.Int).Mul(big.NewInt(-121665), inv)
		return d.Mod(d, fieldP)
	}()
)

// cofactorDoublings: [8]P is three doublings.
const cofactorDoublings = 3

// strictPoint reports whether enc is a canonical encoding (y < p) of a point
// that is not of small order. A point off the curve passes here and fails in
// the signature check itself.
func strictPoint(enc []byte) bool {
	if len(enc) != 32 {
		return false
	}
	le := make([]byte, 32)
	for i := range enc {
		le[31-i] = enc[i]
	}
	le[0] &= 0x7f // the sign bit of x
	y := new(big.Int).SetBytes(le)
	if y.Cmp(fieldP) >= 0 {
		return false
	}
	return !smallOrder(y)
}

// smallOrder reports whether the point with this y has order dividing 8,
// i.e. [8]P is the identity (0, 1). Doubling on -x² + y² = 1 + d·x²·y² needs
// only y and x², and x² = (y² - 1) / (d·y² + 1) follows from y, so no square
// root is taken: y(2P) = (y² + x²) / (1 - d·x²·y²).
func smallOrder(y *big.Int) bool {
	p := fieldP
	one := big.NewInt(1)
	cur := new(big.Int).Set(y)
	for i := 0; i < cofactorDoublings; i++ {
		y2 := new(big.Int).Mul(cur, cur)
		y2.Mod(y2, p)
		den := new(big.Int).Mul(curveD, y2)
		den.Add(den, one).Mod(den, p)
		inv := new(big.Int).ModInverse(den, p)
		if inv == nil {
			return false // not a point: the signature check fails it
		}
		x2 := new(big.Int).Sub(y2, one)
		x2.Mul(x2, inv).Mod(x2, p)
		num := new(big.Int).Add(y2, x2)
		num.Mod(num, p)
		dd := new(big.Int).Mul(curveD, x2)
		dd.Mul(dd, y2)
		dd.Sub(one, dd).Mod(dd, p)
		inv = new(big.Int).ModInverse(dd, p)
		if inv == nil {
			return false
		}
		cur = num.Mul(num, inv)
		cur.Mod(cur, p)
	}
	return cur.Cmp(one) == 0
}
