//! Lanes: messages that share an ordering key run one at a time, in the order they came;
//! lanes run at once.

use std::hash::Hash;

/// Groups positions `0..n` into lanes by ordering key, each lane in order, the lanes in
/// the order of their first position. A position without a key gets a lane of its own.
pub fn lanes<K: Hash + Eq>(keys: impl Iterator<Item = Option<K>>) -> Vec<Vec<usize>> {
    let keys: Vec<Option<K>> = keys.collect();
    // A keyless position is its own key: no other position shares its lane.
    crate::backend::group_by(0..keys.len(), |&i| keys[i].as_ref().ok_or(i))
}

/// How many leading positions, up to `cap`, have ordering keys no earlier one shares: the
/// messages that can run at once when they open a chunk (a keyless position shares
/// nothing).
pub fn distinct_prefix<K: Hash + Eq>(keys: impl Iterator<Item = Option<K>>, cap: usize) -> usize {
    let mut seen = std::collections::HashSet::new();
    keys.take(cap)
        .map_while(|k| match k {
            None => Some(()),
            Some(k) => seen.insert(k).then_some(()),
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_distinct_prefix_ends_at_a_repeated_key_or_the_cap() {
        let keys = [Some("a"), None, Some("b"), None, Some("a"), Some("c")];
        assert_eq!(distinct_prefix(keys.into_iter(), 8), 4);
        assert_eq!(distinct_prefix(keys.into_iter(), 3), 3);
        assert_eq!(distinct_prefix([Some("a"), Some("a")].into_iter(), 8), 1);
        assert_eq!(distinct_prefix(std::iter::empty::<Option<&str>>(), 8), 0);
    }

    #[test]
    fn lanes_keep_each_key_in_order_and_give_keyless_positions_their_own() {
        let keys = [
            Some("a"),
            Some("b"),
            None,
            Some("a"),
            None,
            Some("c"),
            Some("b"),
        ];
        let lanes = lanes(keys.into_iter());
        assert_eq!(
            lanes,
            vec![vec![0, 3], vec![1, 6], vec![2], vec![4], vec![5]]
        );
    }
}
